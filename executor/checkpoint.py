"""Training state saved and loaded with torch.distributed.checkpoint (DCP), independent of the plan's layout.

Keys are the model's canonical names (executor.stages: a parameter's first name in the full model), never a
stage's or a wrapper's, so a checkpoint written under one plan loads into any other plan of the same model:
    model.<name>              parameter or persistent buffer (a DTensor shard under FSDP2, else the full tensor)
    optim.<name>.<state>      optimizer state of that parameter (exp_avg, exp_avg_sq, step, momentum_buffer)
    rng.rank<R>.torch / .cuda / .py   RNG states of rank R (uint8 tensors; loaded by the same rank, if it exists)
Every rank passes the tensors it holds; DCP records each one's global shape and which slice this rank has, writes
a replicated tensor once (its default planner de-duplicates), and on load reads into each tensor exactly the slice
it holds, whatever slices were written: that is the resharding (shared/torch-on-cpu.md section 5 measured FSDP2
W=4 -> W=1..4 to be exact). ZeroRedundancyOptimizer keeps whole parameters' states on their owner rank only: the
owner passes them, so they are written once and land on whichever rank owns them in the new plan.
"""
from __future__ import annotations

import os
import pickle
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from executor import checkpoint_layout as layout


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding per-parameter state: ZeroRedundancyOptimizer keeps its shard's in `.optim`."""
    return getattr(optimizer, "optim", optimizer)


def state_dict(params: dict[str, nn.Parameter], buffers: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
               *, rng_rank: int | None) -> dict[str, Any]:
    """This rank's share of the training state under canonical keys (tensors alias the live ones: DCP loads in
    place)."""
    sd: dict[str, Any] = {f"model.{n}": p.detach() for n, p in params.items()}
    sd.update({f"model.{n}": b for n, b in buffers.items()})
    name_of = {id(p): n for n, p in params.items()}
    for p, state in inner_optimizer(optimizer).state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                sd[f"optim.{name_of[id(p)]}.{key}"] = value
    if rng_rank is not None:
        sd.update({f"rng.rank{rng_rank}.{k}": v for k, v in rng_state().items()})
    return sd


def rng_state() -> dict[str, torch.Tensor]:
    out = {"torch": torch.get_rng_state(),
           "py": _bytes_tensor(pickle.dumps((random.getstate(), np.random.get_state())))}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["torch"])
    py, np_state = pickle.loads(tensors["py"].numpy().tobytes())
    random.setstate(py)
    np.random.set_state(np_state)
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def init_optimizer_state(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    """Create the optimizer's per-parameter state (torch optimizers make it lazily, on the first step) so that DCP
    has tensors to load into: one step with zero gradients and learning rate 0 leaves every parameter unchanged
    (AdamW's decay is lr * wd = 0 too) and makes every state tensor with its final shape and placement; the load
    then overwrites all of them. Collective under ZeroRedundancyOptimizer (its step broadcasts), like its step."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)


def save(sd: dict[str, Any], root: Path, step: int, meta_fields: dict) -> Path | None:
    """Every rank: write `sd` into DIR/.incomplete-step-N, then rank 0 commits it as DIR/step-N (returned on
    rank 0). Each rank hashes the files it wrote, in parallel, for the meta."""
    rank = dist.get_rank()
    tmp = layout.incomplete_dir(root, step)
    if rank == 0:
        if tmp.exists():       # left by a save that was killed
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(sd, checkpoint_id=str(tmp))
    mine = [layout.digest(p) for p in sorted(tmp.iterdir()) if p.name.startswith(f"__{rank}_")]
    gathered: list[Any] = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object([f.to_dict() for f in mine], gathered, dst=0)
    final = None
    if rank == 0:
        files = [layout.FileDigest.from_dict(f) for per_rank in gathered for f in per_rank]
        final = layout.commit(root, step, meta_fields, files)
    dist.barrier()             # the checkpoint is committed before any rank goes on (or reports it)
    return final


def load(sd: dict[str, Any], step_dir: Path) -> dict[str, torch.Tensor]:
    """Load `sd` in place from `step_dir` (keys absent from the checkpoint, such as RNG states of ranks it did not
    have, are left out and returned untouched); works with or without a process group."""
    saved = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    missing = [k for k in sd if k not in saved and not k.startswith("rng.")]
    if missing:
        raise layout.CheckpointError(f"checkpoint {step_dir} has no {missing[0]} (and {len(missing) - 1} more keys "
                                     f"this plan needs); was it written for another model?")
    # RNG states are read into fresh tensors of the saved size (a pickled Python RNG state varies in length)
    wanted = {k: torch.empty(saved[k].size, dtype=torch.uint8) if k.startswith("rng.") else v
              for k, v in sd.items() if k in saved}
    try:
        with warnings.catch_warnings():   # without a process group DCP warns that it loads in one process: intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(wanted, checkpoint_id=str(step_dir))
    except dcp.CheckpointException as exc:
        first = next(iter(exc.failures.values()), exc)
        line = (str(first).strip().splitlines() or [""])[-1]
        raise layout.CheckpointError(f"loading checkpoint {step_dir} failed: {type(first).__name__}: {line}") from None
    return {k: v for k, v in wanted.items() if k.startswith("rng.")}


def restore_rng(loaded: dict[str, torch.Tensor], rank: int) -> bool:
    prefix = f"rng.rank{rank}."
    mine = {k[len(prefix):]: v for k, v in loaded.items() if k.startswith(prefix)}
    if "torch" in mine and "py" in mine:
        set_rng_state(mine)
        return True
    return False


def full_state(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Unsharded copies of the model and optimizer entries of `sd` (collective over the data-parallel group for
    FSDP2 shards: every rank of a stage must call it; keys are visited sorted, the same order on each)."""
    out = {}
    for key in sorted(sd):
        if key.startswith("rng."):
            continue
        value = sd[key]
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[key] = value.detach().clone()
    return out


DUMP_STATE_ENV = "ZEROPIPE_DUMP_STATE"   # test hook: a folder; ranks torch.save full_state() after loads and saves


def dump_for_tests(sd: dict[str, Any], tag: str) -> None:
    folder = os.environ.get(DUMP_STATE_ENV)
    if folder:
        state = full_state(sd)
        torch.save(state, Path(folder) / f"{tag}-rank{dist.get_rank() if dist.is_initialized() else 0}.pt")
