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

from cost_models.models.losses import output_refusal, own_logits, own_loss, takes_targets
from cost_models.models.pipelining import pipeline_support
from cost_models.models.source import meta_forward_context
from cost_models.records.errors import ConfigError
from cost_models.records.strategy import Strategy
from cost_models.torch_compat.devices import rank_device
from cost_models.torch_compat.torch_private import (default_group_timeout, default_store, schedule_stages,
                                                    set_group_timeout)
from executor import checkpoint, context_parallel, pipeline, tensor_parallel
from executor.context_parallel import CPContext
from executor.materialize import allocate, init_held, init_mode, parameters_on_meta, release_unheld
from executor.stage_builders import build_stages
from executor.stages import (UnitMap, canonical_names, check_covers_model, recompute_units, state_maps, tied_params,
                             tied_units)
from executor.traced_stages import as_tuple
from executor.expert_parallel import shard_experts, sync_expert_grads, whole_expert
from executor.zero import Experts, Wrapped, all_reduce_grads, local_bytes, wrap

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
    model: nn.Module | None = None       # the user's model object: with pp = 1 the one trained, else the stages' source
    init: str = ""                       # how the weights were drawn (executor.materialize): factory | per-module
    tp_rank: int = 0                     # this rank's place in its tensor-parallel group (mesh (pp, dp, tp))
    sharded_logits: bool = False         # the logits stay split on the vocabulary: loss under loss_context
    own_loss: bool = False               # the model computes its loss from targets (losses.takes_targets)
    cp: CPContext | None = None          # context parallelism: this rank's place in its CP group (its data rank
                                         # dp_rank holds the tokens cp.split gives of replica dp_rank // cp.cp)
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
        with self.cp.steps() if self.cp else contextlib.nullcontext():
            if s.n_stages == 1:
                loss: torch.Tensor | None = self._accumulate(inputs, targets)
            else:
                with tensor_parallel.loss_context(self.sharded_logits):
                    losses = pipeline.step(self.schedule, is_first=self.is_first, is_last=self.is_last,
                                           inputs=inputs, targets=targets, own_loss=self.own_loss)
                loss = torch.stack([tensor_parallel.local_value(l.detach()) for l in losses]).mean() if losses else None
        t0 = time.perf_counter()
        if self.wrapped.manual_grad_sync:
            all_reduce_grads(self.wrapped.dense_params, self.dp_group, self.wrapped.reduce_dtype)
        if self.wrapped.experts:
            sync_expert_grads(self.wrapped.experts, self.wrapped.expert_group, self.wrapped.ep,
                              self.wrapped.reduce_dtype)
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
                # DDP all-reduces once, on the last micro-batch (wrapped.modules are typed nn.Module)
                sync = module.no_sync()  # type: ignore[operator]
            if self.wrapped.sync_last_only:   # FSDP2: gradients accumulate whole, parameters stay gathered
                module.set_requires_gradient_sync(i == m - 1)  # type: ignore[operator]
                module.set_reshard_after_backward(i == m - 1)  # type: ignore[operator]
            t0 = time.perf_counter()
            with sync, tensor_parallel.loss_context(self.sharded_logits):
                with self._autocast(x):
                    loss = self._loss(module, x, y) / m
                loss.backward()   # outside autocast, as torch's AMP recipe has it (backward runs forward's dtypes)
            self.timings["compute"] += time.perf_counter() - t0
            total += tensor_parallel.local_value(loss.detach()).cpu()
        return total

    def _loss(self, module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.own_loss:
            return own_loss(module(x, y))
        return self.loss_fn(logits_of(module(x)), y)

    def _autocast(self, x: torch.Tensor):
        """Mixed precision's autocast where FSDP2 does not cast (executor.zero.mixed_precision)."""
        dtype = self.wrapped.autocast
        return torch.autocast(x.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def rank_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a step's whole global batch (sequences along dim 0, tokens along dim 1): its
        replica's microbatches x micro_batch_size sequences, and under context parallelism (the data ranks are dp x
        cp, a CP group cp consecutive ones) its chunks of their tokens (cp.split)."""
        cp = self.cp
        if cp is not None and inputs.shape[1] != cp.seq_len:
            raise ConfigError(f"rank_batch takes whole sequences of the plan's {cp.seq_len} tokens; got "
                              f"{inputs.shape[1]}")
        per_replica = self.strategy.microbatches * self.strategy.micro_batch_size
        start = (self.dp_rank // cp.cp if cp else self.dp_rank) * per_replica
        x, y = inputs[start:start + per_replica], targets[start:start + per_replica]
        return (cp.split(x), cp.split(y)) if cp else (x, y)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One optimizer step; returns the replica's loss where this rank can see it (the last stage)."""
        loss = self.forward_backward(inputs, targets)
        self.optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def close(self) -> None:
        """End this rank's part of the job: wait for every rank, then tear down the process group. A rank that
        closes its gloo connections while a peer still reads from them makes the peer's gloo thread abort the
        process ("terminate called without an active exception", SIGABRT). A barrier alone still let that happen:
        the first rank out of it closed while the other was finishing it (the torchrun example under load:
        benchmarks/results/measurements.md, "gloo teardown"). So the ranks also meet on the job's store, outside
        gloo, once all are out of the
        barrier; executor.launch gathers results before it destroys the group for the same reason."""
        if dist.is_initialized():
            dist.barrier()
            _all_out_of_gloo(dist.get_world_size())
            dist.destroy_process_group()

    def state_dict(self, *, with_rng: bool = True) -> dict:
        """This rank's share of the training state under canonical names (executor.checkpoint's layout)."""
        w = self.wrapped
        experts = {id(p) for p in w.experts}
        place = (lambda t, p: whole_expert(t, p, mesh=w.expert_mesh, ep=w.ep) if id(p) in experts else t)
        return checkpoint.state_dict(self.params_by_name, self.buffers_by_name, self.optimizer,
                                     rng_rank=dist.get_rank() if with_rng else None, place=place)

    def local_bytes(self) -> tuple[int, int, int]:
        return local_bytes(self.wrapped.params, self.wrapped.optimizer)


def _all_out_of_gloo(world: int, timeout_s: float = 60.0) -> None:
    """Count this rank in on the default store and wait until all `world` ranks of this round have: a counter
    that grows by `world` per close, so a store that outlives one process group still works."""
    store = default_store()
    arrived = int(store.add(_CLOSED_KEY, 1))
    target = -(-arrived // world) * world
    deadline = time.monotonic() + timeout_s
    while int(store.add(_CLOSED_KEY, 0)) < target and time.monotonic() < deadline:
        time.sleep(0.001)


_CLOSED_KEY = "zeropipe/closed"


@dataclass(frozen=True)
class ModelSpec:
    """What the runtime needs to build the plan's model: `build()` makes it in the caller's device context (the
    model's own constructor: a zoo entry, a factory, an HF config), and its units' modules."""

    build: Callable[[], nn.Module]
    units: UnitMap
    tp_rules: tuple = ()   # a custom tensor-parallel plan's rules (the profile's TPShape.rules); (): the built-in plan


def build_runtime(strategy: Strategy, spec: ModelSpec, *, loss_fn: LossFn, optimizer_fn, example: torch.Tensor | None,
                  seed: int = 0, device: torch.device | None = None, local_ranks: int = 1,
                  loading: bool = False, builtin_cross_entropy: bool = False,
                  compute: torch.dtype | None = None, preload=None) -> Runtime:
    """Apply `strategy` to the model of `spec` on this rank of an initialised process group.

    The model is built on meta first (names, ties, the stages' static shapes from `example`, one micro-batch of
    input; pipelines need it), then for real with its own initialisation (executor.materialize), keeping only this
    rank's share. `loading`: pretrained weights will be loaded into it (executor.weights), so nothing is drawn and,
    under FSDP2, no rank ever holds more than its shards. `compute`: mixed precision's compute dtype
    (executor.zero.mixed_precision; pp = 1 only). `preload(params, buffers, model)`: with expert parallelism,
    pretrained weights loaded into the whole model before this rank keeps its experts. With context parallelism
    (strategy.cp > 1) the runtime runs its data_view on this rank's tokens of `example` (whole sequences)."""
    s = strategy.data_view()
    _check_world(s)
    device = device or rank_device()
    with torch.device("meta"):
        meta = spec.build()
    own = takes_targets(meta)
    support = pipeline_support(meta, [(u, spec.units.names(u)) for st in s.stages for u in st]) if s.pp > 1 else ""
    check_covers_model(meta, s.stages, spec.units, model_level=s.pp == 1 or support == "traced")
    example, seq_len = context_parallel.rank_example(example, strategy.cp)
    tensor_parallel.check_tp(meta, s.tp, sp=s.sp, seq_len=seq_len // strategy.cp, rules=spec.tp_rules, pp=s.pp)
    stage_io = _stage_io(meta, s, spec.units, support, example, own)
    ties = tied_params(meta, s.stages, s.stage_rank, spec.units)
    # the schedule registry's guards; the planner never plans these
    unsafe = s.unsafe_reason() or s.split_tie(tied_units(meta, s.stages, spec.units))
    if unsafe:
        raise ConfigError(unsafe)
    canon = canonical_names(meta)
    mode = "loaded" if loading else init_mode(meta, local_ranks)
    del meta
    mesh, (pp_rank, dp_rank, tp_rank) = _mesh(s, device)
    stage_ids = list(s.rank_stages(pp_rank))
    model, held = _materialized(s, spec, mode, stage_ids, support, seed, device)
    # torchtitan's order: tensor (+ sequence) parallelism, then activation checkpointing, then FSDP2
    sharded_logits = s.tp > 1 and tensor_parallel.parallelize(
        model, held, mesh["tp"], sp=s.sp, rules=spec.tp_rules, loss_parallel=builtin_cross_entropy and not own,
        save_shard=s.sp_save_shard)
    # before selective recompute wraps the same modules (context_parallel.apply)
    cp = _context_parallel(strategy, dp_rank, device, seq_len, model, held) if strategy.cp > 1 else None
    _prepare_units(s, model, held, stage_ids, spec.units, tp_mesh=mesh["tp"] if s.async_tp else None)
    wrapped = wrap(held, zero=s.zero if s.dp > 1 else 0, pp=s.pp, dp_mesh=mesh["dp"], optimizer_fn=optimizer_fn,
                   unit_groups=[[m for _, m in spec.units.parts(model, u)] for u in s.stages[0]] if s.pp == 1 else None,
                   tp=s.tp, compute=compute if s.pp == 1 else None,
                   distributed_optimizer=s.distributed_optimizer and s.dp > 1,
                   experts=_expert_parallel(s, model, held, mode, dp_rank, device, preload, canon))
    if _shards_later(s, mode):
        _allocate_shards(wrapped, optimizer_fn, device, model=model, mode=mode, seed=seed, dp_rank=dp_rank, dp=s.dp)
    schedule = None
    if s.n_stages > 1:
        schedule = pipeline.build_schedule(wrapped.modules, stage_ids, strategy=s, pp_group=mesh["pp"].get_group(),
                                           device=device, loss_fn=_pipeline_loss(loss_fn, own),
                                           stage_io=stage_io, pp_rank=pp_rank)
    params, buffers = state_maps(model, held, canon)
    return Runtime(strategy=s, pp_rank=pp_rank, dp_rank=dp_rank, stage_ids=stage_ids, wrapped=wrapped,
                   loss_fn=loss_fn, schedule=schedule, dp_group=mesh["dp"].get_group() if s.dp > 1 else None,
                   tie_groups=_tie_groups(s, ties, dist.get_rank()), params_by_name=params, buffers_by_name=buffers,
                   model=model, init=mode, tp_rank=tp_rank, sharded_logits=sharded_logits, own_loss=own, cp=cp)


def _stage_io(meta: nn.Module, s: Strategy, units: UnitMap, support: str, example: torch.Tensor | None,
              own: bool) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """A pipeline's stage example tensors (stage_io_shapes; [] without one), as sequence parallelism shards them."""
    if s.n_stages == 1:
        return []
    assert example is not None, "a pipeline needs `example`, one micro-batch, for its static shapes"
    stage_io = stage_io_shapes(meta, s, units, support, example, own_loss=own)
    return tensor_parallel.sequence_sharded_io(stage_io, s.tp) if s.sp else stage_io


def _context_parallel(s: Strategy, dp_rank: int, device: torch.device, seq_len: int, model: nn.Module,
                      held: list[nn.Module]) -> CPContext:
    """This rank's CP group on the (pp, dp, cp, tp) mesh: the cp consecutive data ranks of data_view's dp x cp
    that hold the same sequences (torchtitan's order: cp inside the data-parallel ranks, tp innermost); the held
    modules' attention run over it (context_parallel.apply)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = _cached_group(("cp-mesh", device.type, s.pp, s.dp, s.cp, s.tp), lambda: init_device_mesh(
        device.type, (s.pp, s.dp, s.cp, s.tp), mesh_dim_names=("pp", "cdp", "cp", "tp")))
    group = mesh["cp"].get_group()
    set_group_timeout(group, default_group_timeout(device))
    cp = CPContext(group=group, cp=s.cp, index=dp_rank % s.cp, seq_len=seq_len, device=device)
    cp.biases   # made here, outside any dispatch mode (CPContext.biases)
    context_parallel.apply(model, held, cp)
    return cp


def _expert_parallel(s: Strategy, model: nn.Module, held: list[nn.Module], mode: str, dp_rank: int,
                     device: torch.device, preload, canon) -> Experts | None:
    """This rank's experts (executor.expert_parallel), on the (pp, dp / ep, ep, tp) mesh: an EP group is ep
    consecutive dp ranks, the experts' data-parallel group the dp / ep ranks at the same place in theirs.
    `preload`: pretrained weights, loaded into the whole model first (build_runtime). None without EP."""
    from torch.distributed.device_mesh import init_device_mesh
    if s.ep == 1:
        return None
    if mode != "factory":
        raise ConfigError(f"expert parallelism needs the whole model built on every rank first (init {mode}: it "
                          f"does not fit the host {dist.get_world_size()} times); use ep = 1")
    mesh = _cached_group(("ep-mesh", device.type, s.pp, s.dp, s.ep, s.tp), lambda: init_device_mesh(
        device.type, (s.pp, s.dp // s.ep, s.ep, s.tp), mesh_dim_names=("pp", "edp", "ep", "tp")))
    timeout = default_group_timeout(device)
    for dim in ("edp", "ep"):
        set_group_timeout(mesh[dim].get_group(), timeout)
    if preload is not None:
        preload(*state_maps(model, held, canon), model)
    params = shard_experts(model, ep=s.ep, ep_rank=dp_rank % s.ep, group=mesh["ep"].get_group())
    mine = {id(p) for p in params}   # those this rank's modules hold (a pipeline's other stages are on meta)
    modules = [m for h in held for m in h.modules() if any(id(p) in mine for p in m.parameters(recurse=False))]
    return Experts(modules=modules, mesh=mesh["edp"] if s.dp // s.ep > 1 else None, ep=s.ep,
                   whole=_whole_experts_mesh(s, device) if s.gathers_per_unit and s.dp // s.ep > 1 else mesh["ep"])


def _whole_experts_mesh(s: Strategy, device: torch.device):
    """The (ep, edp) mesh of the experts' checkpoint placement under FSDP2 (expert_parallel.whole_expert): the
    ranks of the (pp, edp, ep, tp) mesh with its middle dimensions swapped, so the EP rank's rows come first."""
    from torch.distributed.device_mesh import DeviceMesh
    ranks = torch.arange(s.world_size).reshape(s.pp, s.dp // s.ep, s.ep, s.tp).transpose(1, 2)
    mesh = _cached_group(("ep-whole", device.type, s.pp, s.dp, s.ep, s.tp), lambda: DeviceMesh(
        device.type, ranks, mesh_dim_names=("pp", "ep", "edp", "tp")))
    return mesh["ep", "edp"]


def _check_world(s: Strategy) -> None:
    if dist.get_world_size() != s.world_size:
        raise ConfigError(f"the plan needs {s.world_size} ranks (dp={s.dp} x tp={s.tp} x pp={s.pp}), this job has "
                          f"{dist.get_world_size()}")


def _pipeline_loss(loss_fn: LossFn, own: bool) -> Callable:
    """The last stage's loss: the model's own (its traced last stage returns it: traced_stages.loss_vector), or
    `loss_fn` on its logits."""
    if own:
        return lambda out, _y: out.sum()   # its one element; a new tensor: zero-bubble backward detaches it in place
    return lambda out, y: loss_fn(logits_of(out), y)


def _prepare_units(s: Strategy, model: nn.Module, held: list[nn.Module], stage_ids: list[int], units: UnitMap, *,
                   tp_mesh=None) -> None:
    """Full recompute of the stages the plan says (their units under torch.utils.checkpoint), and selective
    recompute (the attention core) in the others; then, with async TP (`tp_mesh`), the units compiled with its
    micro-pipelining, torchtitan's order (tensor_parallel.enable_async_tp)."""
    sids = [0] if s.pp == 1 else stage_ids
    recompute_units(model, s.stages, sids, units, s.recompute)
    if s.selective:
        full = {id(sub) for sid in sids if s.stage_recompute(sid) for u in s.stages[sid]
                for _, m in units.parts(model, u) for sub in m.modules()}
        tensor_parallel.selective_recompute(model, held, full)
    if tp_mesh is not None:
        parts = [m for sid in sids for u in s.stages[sid] for _, m in units.parts(model, u)]
        tensor_parallel.enable_async_tp(parts, tp_mesh, next(p for m in held for p in m.parameters()).device)


# Groups made in this process, per world (the default group) and shape. A rank that runs several plans in turn
# (benchmarks/fidelity.py, the tests' shared ranks) would otherwise make new ones for each: gloo keeps a thread per
# group, never freed while the world lives (measured: benchmarks/results/measurements.md, "gloo groups per
# process"). new_group is collective: every rank runs the same plans in
# the same order, so every rank finds or makes the same groups.
_GROUPS: dict[tuple, object] = {}


def _cached_group(key: tuple, make):
    key = (dist.group.WORLD, *key)
    if key not in _GROUPS:
        _GROUPS[key] = make()
    return _GROUPS[key]


def _mesh(s: Strategy, device: torch.device):
    """The (pp, dp, tp) device mesh (tp innermost: Strategy.coords), its groups given the world's timeout, and this
    rank's (pp, dp, tp) coordinates."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = _cached_group(("mesh", device.type, s.pp, s.dp, s.tp), lambda: init_device_mesh(
        device.type, (s.pp, s.dp, s.tp), mesh_dim_names=("pp", "dp", "tp")))
    # init_process_group's timeout (`planner run --timeout`). Subgroups do not inherit it: new_group and DeviceMesh's
    # per-dimension groups take torch's default (30 min for gloo, 10 for NCCL), so a stopped pipeline peer left the
    # others waiting in p2p and all-reduce for half an hour (measured: a SIGSTOPped rank of a PP2 x DP2 run,
    # --timeout 5, peers still blocked after 5 minutes).
    timeout = default_group_timeout(device)
    for dim in ("pp", "dp", "tp"):
        set_group_timeout(mesh[dim].get_group(), timeout)
    return mesh, s.coords(dist.get_rank())


def _materialized(s: Strategy, spec: ModelSpec, mode: str, stage_ids: list[int], support: str, seed: int,
                  device: torch.device) -> tuple[nn.Module, list[nn.Module]]:
    """The model built for real (executor.materialize's modes; "loaded": parameters allocated, not drawn, since
    pretrained weights replace them), and the modules this rank trains: the model itself when pp = 1, else its
    stages (parameters of other ranks' stages released to meta). Under FSDP2 with "loaded" or "per-module" the
    parameters stay on meta here: _allocate_shards gives each rank only its shards after wrapping."""
    if mode == "factory":
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = spec.build()
    else:
        with torch.device("cpu"), parameters_on_meta():
            model = spec.build()
    if s.pp == 1:
        held: list[nn.Module] = [model]
    else:   # recompute is applied after tensor parallelism (build_runtime)
        held = list(build_stages(model, s.stages, stage_ids, units=spec.units, support=support, recompute=()))
    if mode == "factory":
        release_unheld(model, held)
    elif _shards_later(s, mode):
        return model, held
    else:
        allocate(model, held, device)
        if mode == "per-module":
            init_held(model, held, seed)
    for m in held:
        m.to(device)
    return model, held


def _shards_later(s: Strategy, mode: str) -> bool:
    """FSDP2 over meta parameters, allocated as shards after wrapping: to load weights into, or (pp = 1, where
    the model is the root and each parameter's owner is the same on every rank) to draw module by module."""
    # with tp > 1 the parameters are split first, from real tensors (executor.materialize draws FSDP2's dp shards
    # of whole parameters only)
    return s.gathers_per_unit and s.tp == 1 and (mode == "loaded" or (mode == "per-module" and s.pp == 1))


def _allocate_shards(wrapped: Wrapped, optimizer_fn, device: torch.device, *, model: nn.Module, mode: str,
                     seed: int, dp_rank: int, dp: int) -> None:
    """FSDP2 over meta parameters (torchtitan's order): allocate each rank's shards only, never the whole model,
    keeping the buffers the constructor computed (to_empty would leave them uninitialised), draw them ("per-module":
    module by module, executor.materialize.init_held), then build the optimizer over the real shards."""
    for module in wrapped.modules:
        buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
        module.to_empty(device=device)
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    if mode == "per-module":
        init_held(model, wrapped.modules, seed, shard=(dp_rank, dp))
    wrapped.params = [p for m in wrapped.modules for p in m.parameters()]
    wrapped.optimizer = optimizer_fn(wrapped.params)


def _tie_groups(s: Strategy, ties, rank: int) -> list[tuple[str, object]]:
    """Tied parameters on several pipeline ranks: one group per (tied parameter, dp index, tp index), created in the
    same order on every rank (new_group is collective). The plans keep tied parameters whole over tp."""
    timeout = default_group_timeout(rank_device())
    out = []
    for tied in ties:
        for d in range(s.dp):
            for t in range(s.tp):
                members = [s.rank_at(r, d, t) for r in tied.pp_ranks]
                group = _cached_group(("tie", *members), lambda: dist.new_group(ranks=members, timeout=timeout))
                if rank in members:
                    out.append((tied.canonical, group))
    return out


def logits_of(output) -> torch.Tensor:
    """The tensor a loss is taken on: the output itself, or an output object's `.logits` (transformers' causal LMs
    return CausalLMOutputWithPast; their `labels=` loss is never used: it shifts the targets a second time)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise ConfigError(output_refusal(output, own=False) or f"the model returned {type(output).__name__}")


def example_logits(model: nn.Module, example: torch.Tensor) -> torch.Tensor:
    """The logits of one forward on `example` (a meta model: shapes only), as training calls the model: with
    targets (token ids shaped like the input) where it computes its own loss, whose inference branch gives only the
    last position's, else plainly (logits_of)."""
    if not takes_targets(model):
        return logits_of(model(example))
    out = model(example, example)
    refusal = output_refusal(out, own=True)
    if refusal:
        raise ConfigError(refusal)
    logits = own_logits(out)
    assert logits is not None   # output_refusal checked
    return logits


def stage_io_shapes(meta: nn.Module, s: Strategy, units: UnitMap, support: str, example_input: torch.Tensor, *,
                    own_loss: bool = False) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Example (input, output) tensors of one micro-batch per stage (the float ones with requires_grad, as torch's
    PipelineStage needs), from running every stage in turn on the meta model; `own_loss`: the first stage also
    takes the targets (token ids shaped like the input)."""
    device = rank_device()
    stages = build_stages(meta, s.stages, list(range(s.n_stages)), units=units, support=support, recompute=())
    io = []
    def example(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=device, requires_grad=t.is_floating_point())

    xs: tuple[torch.Tensor, ...] = (example_input.to("meta"),) * (2 if own_loss else 1)
    with meta_forward_context(meta), torch.no_grad():
        for stage in stages:
            outs = as_tuple(stage(*xs))
            io.append((tuple(example(t) for t in xs), tuple(example(t) for t in outs)))
            xs = outs
    return io
