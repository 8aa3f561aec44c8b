"""A plan applied on one rank: mesh, stages, ZeRO mapping, schedule, and a step function.

Used by `planner run` (executor.train) and by users' own scripts (executor.api.apply_plan): both go through
`build_runtime`, so what users run is what the product measured.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from cost_models.errors import ConfigError
from cost_models.strategy import Strategy
from cost_models.torch_private import default_group_timeout, schedule_stages, set_group_timeout
from executor import checkpoint, pipeline
from executor.stages import (build_stages, buffers_by_canonical, canonical_names, params_by_canonical, tied_params,
                             tied_units)
from executor.zero import Wrapped, all_reduce_grads, local_bytes, wrap

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# FSDP2 warns whenever a wrapped module returns a view (an in-place op on it would skip its pre-backward hook).
# Stages hand their output to the schedule or the loss and never modify it in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


@dataclass
class Runtime:
    strategy: Strategy
    pp_rank: int
    dp_rank: int
    stage_ids: list[int]
    wrapped: Wrapped
    loss_fn: LossFn
    schedule: object | None
    dp_group: object | None
    tie_groups: list[tuple[str, object]] = field(default_factory=list)   # (canonical param name, group)
    params_by_name: dict[str, nn.Parameter] = field(default_factory=dict)
    buffers_by_name: dict[str, torch.Tensor] = field(default_factory=dict)
    # Seconds spent this step in stage forward/backward ("compute": it includes the communication FSDP and DDP
    # issue inside them), in the gradient syncs issued after them ("sync"), and in optimizer.step ("optimizer").
    timings: dict[str, float] = field(default_factory=lambda: {"compute": 0.0, "sync": 0.0, "optimizer": 0.0})

    def __post_init__(self) -> None:
        if self.schedule is not None:
            for stage in schedule_stages(self.schedule):
                for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                    if hasattr(stage, name):
                        setattr(stage, name, self._timed(getattr(stage, name), "compute"))

    def _timed(self, fn, key: str):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.timings[key] += time.perf_counter() - t0
        return wrapper

    def reset_timings(self) -> None:
        for key in self.timings:
            self.timings[key] = 0.0

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def is_last(self) -> bool:
        return self.strategy.n_stages - 1 in self.stage_ids

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.wrapped.optimizer

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward over this data-parallel replica's batch (all its micro-batches), gradients synced
        over dp and across tied stages; returns the replica's mean loss on ranks holding the last stage."""
        s = self.strategy
        if s.n_stages == 1:
            loss = self._accumulate(inputs, targets)
        else:
            losses = pipeline.step(self.schedule, is_first=self.is_first, is_last=self.is_last, inputs=inputs,
                                   targets=targets)
            loss = torch.stack([l.detach() for l in losses]).mean() if losses else None
        t0 = time.perf_counter()
        if self.wrapped.manual_grad_sync:
            all_reduce_grads(self.wrapped.params, self.dp_group)
        for name, group in self.tie_groups:
            p = self.params_by_name[name]
            if p.grad is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        self.timings["sync"] += time.perf_counter() - t0
        return loss

    def optimizer_step(self) -> None:
        t0 = time.perf_counter()
        self.optimizer.step()
        self.timings["optimizer"] += time.perf_counter() - t0

    def _accumulate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        m = self.strategy.microbatches
        module = self.wrapped.modules[0]
        total = torch.zeros(())
        for i, (x, y) in enumerate(zip(inputs.chunk(m), targets.chunk(m))):
            sync = contextlib.nullcontext()
            if self.wrapped.ddp and i < m - 1:
                sync = module.no_sync()  # DDP all-reduces once, on the last micro-batch
            t0 = time.perf_counter()
            with sync:
                loss = self.loss_fn(module(x), y) / m
                loss.backward()
            self.timings["compute"] += time.perf_counter() - t0
            total += loss.detach().cpu()
        return total

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One optimizer step; returns the replica's loss where this rank can see it (the last stage)."""
        loss = self.forward_backward(inputs, targets)
        self.optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def state_dict(self, *, with_rng: bool = True) -> dict:
        """This rank's share of the training state under canonical names (executor.checkpoint's layout)."""
        return checkpoint.state_dict(self.params_by_name, self.buffers_by_name, self.optimizer,
                          rng_rank=dist.get_rank() if with_rng else None)

    def local_bytes(self) -> tuple[int, int, int]:
        return local_bytes(self.wrapped.params, self.wrapped.optimizer)


def build_runtime(strategy: Strategy, model: nn.Module, *, loss_fn: LossFn, optimizer_fn, stage_io,
                  seed: int = 0,
                  device: torch.device | None = None) -> Runtime:
    """Apply `strategy` to `model` (built on the meta device) on this rank of an initialised process group.

    stage_io[sid] = (example input, example output) of one micro-batch for stage sid (pipelines need static
    shapes)."""
    from torch.distributed.device_mesh import init_device_mesh

    s = strategy
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != s.world_size:
        raise ConfigError(f"the plan needs {s.world_size} ranks (dp={s.dp} x pp={s.pp}), this job has {world}")
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    mesh = init_device_mesh(device.type, (s.pp, s.dp), mesh_dim_names=("pp", "dp"))
    # init_process_group's timeout (`planner run --timeout`). Subgroups do not inherit it: new_group and DeviceMesh's
    # per-dimension groups take torch's default (30 min for gloo, 10 for NCCL), so a stopped pipeline peer left the
    # others waiting in p2p and all-reduce for half an hour (measured: a SIGSTOPped rank of a PP2 x DP2 run,
    # --timeout 5, peers still blocked after 5 minutes).
    timeout = default_group_timeout(device)
    for dim in ("pp", "dp"):
        set_group_timeout(mesh[dim].get_group(), timeout)
    pp_rank, dp_rank = rank // s.dp, rank % s.dp
    stage_ids = list(s.rank_stages(pp_rank))
    ties = tied_params(model, s.stages, s.stage_rank)
    # the schedule registry's guards; the planner never plans these
    unsafe = s.unsafe_reason() or s.split_tie(tied_units(model, s.stages))
    if unsafe:
        raise ConfigError(unsafe)
    canon = canonical_names(model)
    stages = build_stages(model, s.stages, stage_ids, recompute=s.recompute, seed=seed, device=device)
    dp_mesh = mesh["dp"]
    wrapped = wrap(stages, zero=s.zero if s.dp > 1 else 0, pp=s.pp, dp_mesh=dp_mesh, optimizer_fn=optimizer_fn)
    schedule = None
    if s.n_stages > 1:
        schedule = pipeline.build_schedule(wrapped.modules, stage_ids, strategy=s, pp_group=mesh["pp"].get_group(),
                                           device=device, loss_fn=loss_fn, stage_io=stage_io, pp_rank=pp_rank)
    # Tied parameters on several pipeline ranks: one group per (tied parameter, dp index), created in the same
    # order on every rank (new_group is collective).
    tie_groups = []
    for tied in ties:
        for d in range(s.dp):
            members = [r * s.dp + d for r in tied.pp_ranks]
            group = dist.new_group(ranks=members, timeout=timeout)
            if rank in members:
                tie_groups.append((tied.canonical, group))
    return Runtime(strategy=s, pp_rank=pp_rank, dp_rank=dp_rank, stage_ids=stage_ids, wrapped=wrapped,
                   loss_fn=loss_fn, schedule=schedule, dp_group=dp_mesh.get_group() if s.dp > 1 else None,
                   tie_groups=tie_groups, params_by_name=params_by_canonical(stages, canon),
                   buffers_by_name=buffers_by_canonical(stages))


def stage_io_shapes(model: nn.Module, stages: tuple[tuple[str, ...], ...], example: torch.Tensor,
                    device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Example (input, output) tensors of one micro-batch per stage, from one forward of the model on meta."""
    outputs: dict[str, torch.Tensor] = {}
    hooks = []
    for names in stages:
        for name in names:
            hooks.append(model.get_submodule(name).register_forward_hook(
                lambda mod, args, out, name=name: outputs.__setitem__(name, out)))
    try:
        with torch.no_grad():
            model(example.to("meta"))
    finally:
        for h in hooks:
            h.remove()
    io = []
    prev = example
    for names in stages:
        out = outputs[names[-1]]
        example_in = torch.empty(prev.shape, dtype=prev.dtype, device=device,
                                 requires_grad=prev.is_floating_point())
        example_out = torch.empty(out.shape, dtype=out.dtype, device=device, requires_grad=True)
        io.append((example_in, example_out))
        prev = out
    return io
