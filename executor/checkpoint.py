"""Training state saved and loaded with torch.distributed.checkpoint (DCP), independent of the plan's layout.

Keys are the model's canonical names (executor.stages: a parameter's first name in the full model), never a
stage's or a wrapper's, so a checkpoint written under one plan loads into any other plan of the same model:
    model.<name>              parameter or persistent buffer (a DTensor shard under FSDP2, else the full tensor)
    optim.<name>.<state>      optimizer state of that parameter (exp_avg, exp_avg_sq, step, momentum_buffer)
    rng.rank<R>.torch / .cuda         torch's RNG states of rank R (uint8 tensors, as torch returns them)
    rng.rank<R>.py.* / .np.*          Python's and numpy's RNG states of rank R as int64 / float64 tensors
                                      (loaded by the same rank, if it exists)
Every rank passes the tensors it holds; DCP records each one's global shape and which slice this rank has, writes
a replicated tensor once (its default planner de-duplicates), and on load reads into each tensor exactly the slice
it holds, whatever slices were written: that is the resharding (tests/test_checkpoint.py: a ZeRO-3 checkpoint of
4 ranks loads bit-exact into a 2-stage pipeline, which then continues with one process's losses).
ZeroRedundancyOptimizer keeps whole parameters' states on their owner rank only: the owner passes them, so they are
written once and land on whichever rank owns them in the new plan.

Nothing of ours is pickled: a pickle runs code when loaded, and a checkpoint may come from elsewhere. DCP's own
`.metadata` is a pickle, so it is unpickled only from the bytes whose sha256 the signed listing vouches for
(_verified_reader; checkpoint_layout.check_signature), checked again on every rank right before the load, not only by
the launcher.
"""
from __future__ import annotations

import hashlib
import pickle
import random
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from cost_models.records.errors import PlannerError, exception_chain
from cost_models.torch_compat.torch_private import tp_strided
from executor import checkpoint_layout as layout
from executor.testing_hooks import DUMP_STATE_ENV, hook


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding per-parameter state: ZeroRedundancyOptimizer keeps its shard's in `.optim`."""
    return getattr(optimizer, "optim", optimizer)


def state_dict(params: dict[str, nn.Parameter], buffers: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
               *, rng_rank: int | None, place: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
               ) -> dict[str, Any]:
    """This rank's share of the training state under canonical keys (tensors alias the live ones: DCP loads in
    place). `place(tensor, parameter)`: a parameter or one of its states as a slice of the whole model's tensor,
    where this rank's parameter is not already one (expert parallelism: expert_parallel.whole_expert)."""
    place = place or (lambda t, _p: t)
    sd: dict[str, Any] = {f"model.{n}": place(p.detach(), p) for n, p in params.items()}
    sd.update({f"model.{n}": b for n, b in buffers.items()})
    name_of = {id(p): n for n, p in params.items()}
    # ZeRO-1 under tensor parallelism steps plain stand-ins of the DTensor parameters (executor.zero.LocalShardZeRO)
    param_of = {**{id(p): p for p in params.values()}, **getattr(optimizer, "stands_for", {})}
    for p, state in inner_optimizer(optimizer).state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                param = param_of[id(p)]
                sd[f"optim.{name_of[id(param)]}.{key}"] = place(_placed_like(value, param), param)
    if rng_rank is not None:
        sd.update({f"rng.rank{rng_rank}.{k}": v for k, v in rng_state().items()})
    return _whole_if_strided(sd)


class _StateDict(dict):
    """A state dict whose `strided` entries are whole copies of tensor-parallel strided DTensors (the targets)."""

    strided: dict[str, torch.Tensor]


def _whole_if_strided(sd: dict[str, Any]) -> _StateDict:
    """DCP cannot chunk a fused projection's parts split over tp (GPT's c_attn, each rank a slice of q, k and v;
    measured, torch 2.13: dcp.save fails with "overlapping chunks"): such tensors go in whole (plain tensors, written
    once, read by any plan) and load() copies each rank's slice back (_restore_strided). Collective over each such
    tensor's mesh, in the same order on every rank of a stage."""
    out = _StateDict()
    out.strided = {}
    for key, value in sd.items():
        if tp_strided(value):
            out.strided[key] = value
            value = value.full_tensor()
        out[key] = value
    return out


def _restore_strided(sd: dict[str, Any]) -> None:
    from torch.distributed.tensor import distribute_tensor
    for key, target in getattr(sd, "strided", {}).items():
        mine = distribute_tensor(sd[key], target.device_mesh, target.placements, src_data_rank=None).to_local()
        with torch.no_grad():
            target.to_local().copy_(mine)


def _placed_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A stand-in's state (a plain tensor of the local shard) as a DTensor placed as its parameter, aliasing the
    same storage (DCP loads in place), so the checkpoint records the global shape and this rank's slice."""
    # past the first test `param` is a DTensor (it has a device_mesh), typed torch.Tensor: no to_local, placements
    if (not hasattr(param, "device_mesh") or hasattr(value, "device_mesh")
            or value.shape != param.to_local().shape):  # type: ignore[attr-defined]
        return value
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(value, param.device_mesh, param.placements,  # type: ignore[attr-defined]
                              run_check=False, shape=param.shape, stride=param.stride())


# The states every rank saves and needs back (cuda only where there is one).
RNG_KEYS = ("torch", "py.version", "py.state", "py.gauss", "np.state", "np.pos", "np.gauss")


def rng_state() -> dict[str, torch.Tensor]:
    """This process's RNG states as plain tensors. Python's random.getstate() is (version, 625 ints: the 624 32-bit
    words of its Mersenne Twister and the position, gauss_next or None); numpy's legacy np.random.get_state() is
    ('MT19937', 624 uint32 words, position, has_gauss, cached_gaussian). Every int fits int64 and every float is
    a double, so the round trip is exact."""
    version, words, gauss_next = random.getstate()
    # numpy's stubs give get_state() its legacy=False overload (a dict); the default, legacy=True, returns this tuple
    np_state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    algorithm, np_words, pos, has_gauss, cached = np_state
    assert algorithm == "MT19937", algorithm   # the only one np.random's legacy generator has
    out = {"torch": torch.get_rng_state(),
           "py.version": torch.tensor([version], dtype=torch.int64),
           "py.state": torch.tensor(words, dtype=torch.int64),
           "py.gauss": torch.tensor([gauss_next is not None, gauss_next or 0.0], dtype=torch.float64),
           "np.state": torch.from_numpy(np_words.astype(np.int64)),
           "np.pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
           "np.gauss": torch.tensor([cached], dtype=torch.float64)}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(tensors: dict[str, torch.Tensor]) -> None:
    """Restore each generator whose state is there: a checkpoint from before these keys existed has only torch's
    (its Python and numpy states were one pickle, which is not loaded)."""
    if "torch" in tensors:
        torch.set_rng_state(tensors["torch"])
    if all(f"py.{k}" in tensors for k in ("version", "state", "gauss")):
        has_gauss, gauss_next = tensors["py.gauss"].tolist()
        random.setstate((int(tensors["py.version"][0]), tuple(tensors["py.state"].tolist()),
                         gauss_next if has_gauss else None))
    if all(f"np.{k}" in tensors for k in ("state", "pos", "gauss")):
        pos, np_has_gauss = tensors["np.pos"].tolist()
        np.random.set_state(("MT19937", tensors["np.state"].numpy().astype(np.uint32), pos, np_has_gauss,
                             float(tensors["np.gauss"][0])))
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])


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
    rank 0). Each rank hashes the files it wrote, in parallel, for the meta. A save that fails (a full disk)
    raises CheckpointSaveError on every rank with its root cause in one line, after rank 0 removed the partial
    folder (it would go on filling the disk, and is never read)."""
    rank = dist.get_rank()
    tmp = layout.incomplete_dir(root, step)
    if rank == 0:
        if tmp.exists():       # left by a save that was killed
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    try:
        dcp.save(sd, storage_writer=_Writer(str(tmp)))
    except dcp.CheckpointException as exc:   # every rank gets it: DCP gathers the failures and broadcasts them
        cause = failure_text(exc)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()         # no rank says the folder was removed before it was
        raise _save_failed(root, step, cause) from None
    mine = [layout.digest(p) for p in sorted(tmp.iterdir()) if p.name.startswith(f"__{rank}_")]
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object([f.to_dict() for f in mine], gathered, dst=0)
    final = None
    outcome: list[str | None] = [None]
    if rank == 0:
        assert gathered is not None   # rank 0 made the list to gather into
        files = [layout.FileDigest.from_dict(f) for per_rank in gathered for f in per_rank]
        try:
            final = layout.commit(root, step, meta_fields, files)
        except (OSError, PlannerError) as exc:   # writing the meta or signature; the signing key
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = [failure_text(exc)]
    dist.broadcast_object_list(outcome, src=0)   # committed (or given up) before any rank goes on or reports it
    if outcome[0]:
        raise _save_failed(root, step, outcome[0])
    return final


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, raising the OSError under a failed write itself: torch's zip writer reports a write that
    failed with ENOSPC or EFBIG as "unexpected pos 704 vs 598" (the OSError is only its __context__), and DCP sends
    each rank's failure to the others as a pickle, which drops __context__."""

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as exc:
            raise _plain(exc) from None

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception as exc:
            raise _plain(exc) from None


def _plain(exc: BaseException) -> BaseException:
    """The first OSError with an errno in `exc`'s chain, as a fresh one (no chain to lose), else `exc`."""
    return next((OSError(link.errno, link.strerror, link.filename) for link in exception_chain(exc)
                 if isinstance(link, OSError) and link.errno), exc)


def _save_failed(root: Path, step: int, cause: str) -> layout.CheckpointSaveError:
    return layout.CheckpointSaveError(f"saving checkpoint step {step} to {root} failed: {cause}; the partial folder "
                                      f"was removed")


def failure_text(exc: BaseException) -> str:
    """One line for what went wrong: '[Errno 28] No space left on device' for the first OSError among DCP's
    per-rank failures (lowest rank first; _Writer put it there), else the first failure's last line. (A
    CheckpointException prints every rank's traceback: hundreds of lines.)"""
    failures = [pair[0] if isinstance(pair, tuple) else pair for _, pair in sorted(exc.failures.items())] \
        if isinstance(exc, dcp.CheckpointException) else [exc]
    for failure in map(_plain, failures):
        if isinstance(failure, OSError):
            return f"[Errno {failure.errno}] {failure.strerror}"
    first = failures[0] if failures else exc
    if isinstance(first, PlannerError):
        return str(first)
    return f"{type(first).__name__}: {(str(first).strip().splitlines() or [''])[-1]}"


class _VerifiedReader(dcp.FileSystemReader):
    """DCP's file reader, unpickling the `.metadata` bytes that were checked against the signed listing instead of
    reading the file again (which could have been swapped after the check)."""

    def __init__(self, path: str, metadata_bytes: bytes) -> None:
        super().__init__(path)
        self._metadata = metadata_bytes

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = pickle.loads(self._metadata)   # verified: sha256 listed in the signed meta (or trusted by the user)
        if getattr(metadata, "storage_meta", None) is None:   # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _verified_reader(step_dir: Path, trusted: bool) -> _VerifiedReader:
    """Every loader passes here, the launcher's check notwithstanding: the listing's signature (unless `trusted`)
    and `.metadata`'s sha256 are checked on the bytes that are then used, right before DCP unpickles them."""
    meta, _ = layout.read_verified(step_dir, trusted=trusted)
    listed = {f.name: f for f in meta.files}
    if ".metadata" not in listed:
        raise layout.CheckpointError(f"checkpoint {step_dir} does not list its .metadata; it was not written by "
                                     f"planner run")
    data = (step_dir / ".metadata").read_bytes()
    if hashlib.sha256(data).hexdigest() != listed[".metadata"].sha256:
        raise layout.CheckpointError(f"checkpoint {step_dir} is damaged: .metadata does not match its sha256")
    return _VerifiedReader(str(step_dir), data)


def verified_reader(step_dir: Path, *, trusted: bool = False) -> dcp.FileSystemReader:
    """The reader `load` uses, for loaders of another set of keys (executor.weights, --init-from: the model's only):
    the same checks, on the bytes DCP then unpickles (_verified_reader)."""
    return _verified_reader(step_dir, trusted)


def load(sd: dict[str, Any], step_dir: Path, *, trusted: bool = False) -> dict[str, torch.Tensor]:
    """Load `sd` in place from `step_dir` (keys absent from the checkpoint, such as RNG states of ranks it did not
    have, are left out and returned untouched); works with or without a process group. The checkpoint must be
    signed by this installation's key unless `trusted` (_verified_reader)."""
    reader = _verified_reader(step_dir, trusted)
    saved = reader.read_metadata().state_dict_metadata
    missing = [k for k in sd if k not in saved and not k.startswith("rng.")]
    if missing:
        raise layout.CheckpointError(f"checkpoint {step_dir} has no {missing[0]} (and {len(missing) - 1} more keys "
                                     f"this plan needs); was it written for another model?")
    # RNG states are read into fresh tensors of the saved size and type (torch's may differ between versions)
    wanted = {k: _empty_as_saved(saved[k]) if k.startswith("rng.") else v
              for k, v in sd.items() if k in saved and (not k.startswith("rng.") or hasattr(saved[k], "properties"))}
    try:
        with warnings.catch_warnings():   # without a process group DCP warns that it loads in one process: intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(wanted, storage_reader=reader)
    except dcp.CheckpointException as exc:
        raise layout.CheckpointError(f"loading checkpoint {step_dir} failed: {failure_text(exc)}") from None
    _restore_strided(sd)
    return {k: v for k, v in wanted.items() if k.startswith("rng.")}


def _empty_as_saved(entry: TensorStorageMetadata | BytesStorageMetadata) -> torch.Tensor:
    """A fresh tensor of a saved tensor's size and type (load keeps only entries with properties: tensors)."""
    assert isinstance(entry, TensorStorageMetadata)
    return torch.empty(entry.size, dtype=entry.properties.dtype)


def restore_rng(loaded: dict[str, torch.Tensor], rank: int) -> bool:
    prefix = f"rng.rank{rank}."
    mine = {k[len(prefix):]: v for k, v in loaded.items() if k.startswith(prefix)}
    set_rng_state(mine)
    return all(k in mine for k in RNG_KEYS)


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


def dump_for_tests(sd: dict[str, Any], tag: str) -> None:
    folder = hook(DUMP_STATE_ENV)
    if folder:
        state = full_state(sd)
        torch.save(state, Path(folder) / f"{tag}-rank{dist.get_rank() if dist.is_initialized() else 0}.pt")
