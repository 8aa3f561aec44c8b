"""ZeRO stages on torch's wrappers, over the "dp" mesh dimension of each stage (stages 1-3 partition optimizer
states, then gradients, then parameters: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC20, sections 5.1-5.3).

                 no pipeline (pp = 1): the model itself         pipeline (pp > 1)
    ZeRO-0       DDP(model)                                    plain stage + gradient all-reduce (AVG) over dp
    ZeRO-1       DDP(model) + ZeroRedundancyOptimizer          plain stage + all-reduce + ZeroRedundancyOptimizer
    ZeRO-2       FSDP2 fully_shard on each unit's modules,     FSDP2 fully_shard(stage), reshard_after_forward=False
                 then the model, reshard_after_forward=False
    ZeRO-3       the same, reshard_after_forward=True          FSDP2 fully_shard(stage), reshard_after_forward=True
    ZeRO-1       as ZeRO-2, gradients reduce-scattered (fp32)  (not offered: the ZeRO-2 column already gathers once
    dist-opt     on the last micro-batch only                  and reduce-scatters once per step)
Why the pipeline column differs: torch's pipelining drives a DDP-wrapped stage by reaching into DDP's reducer
(torch 2.13, torch/distributed/pipelining/stage.py, backward_maybe_with_nosync: no_sync on every backward but the
last, then reducer.prepare_for_backward), and when this module was written DDP-wrapped stages failed here under
GPipe and interleaved schedules (reducer assertion) or gave wrong gradients (static_graph), and nested FSDP2 gave
wrong gradients under zero-bubble schedules. One fully_shard per stage and the manual all-reduce are right for all:
tests/test_executor.py checks them against one process's losses (ZeRO 0-3 alone, every schedule alone, PP2 x DP2
with ZeRO 1-3, zero-bubble among them).
DDP uses gradient_as_bucket_view so gradients are not held twice (the memory model assumes it).

With tensor parallelism (tp > 1) the parameters are DTensors on the tp mesh. FSDP2 shards them over dp as well
(2-D: torchtitan's TP + FSDP2). DDP and ZeroRedundancyOptimizer do not take DTensor parameters (torch 2.13: ZeRO's
broadcast has no DTensor sharding strategy), so ZeRO-0/1 use the pipeline column's mapping at pp = 1 too: the
gradient all-reduce over dp on the local shards, and for ZeRO-1 a ZeroRedundancyOptimizer over the parameters'
local shards (LocalShardZeRO). The optimizers are elementwise, so updating each shard alone is the full update.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

OptimizerFn = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True, kw_only=True)
class Precision:
    """How a plan's precision runs on this device (mixed_precision)."""

    build: torch.dtype                   # the dtype the model's parameters are built in
    compute: torch.dtype | None = None   # mixed precision: the dtype forward and backward compute in


def mixed_precision(precision: str, device: torch.device, pp: int) -> Precision:
    """bf16-mixed on GPUs as torchtitan runs it (torchtitan/distributed/utils.py maybe_enable_amp, and the FSDP2
    MixedPrecisionPolicy of its parallelize functions): the parameters stay fp32 (the master weights; gradients
    and Adam's moments follow their dtype) and compute runs in bf16, through FSDP2's MixedPrecisionPolicy where
    FSDP2 holds the parameters (ZeRO-2/3), else under torch.autocast. Gradients are reduced in bf16, the
    2 bytes per parameter the cost model charges (Rajbhandari et al. 2020 reduce fp16 gradients; torchtitan's
    default reduces in fp32).

    Not yet for pipelines (pp > 1): their stages exchange activations through receive buffers allocated ahead in
    one dtype (executor.pipeline stage_io), and under autocast a stage's output dtype depends on its last op (a
    residual add stays fp32, a Linear's output is bf16); their models are built in plain bf16 (no fp32 master
    weights). CPU ranks run bf16-mixed plans in fp32: bf16 matmuls on CPU run far below fp32's rate."""
    if precision == "fp32" or device.type != "cuda":
        return Precision(build=torch.float32)
    if pp > 1:
        return Precision(build=torch.bfloat16)
    return Precision(build=torch.float32, compute=torch.bfloat16)


@dataclass
class Wrapped:
    modules: list[nn.Module]            # what the schedule / loop calls (DDP, FSDP or plain stages)
    optimizer: torch.optim.Optimizer
    manual_grad_sync: bool               # all-reduce gradients over dp after backward (pipelined ZeRO-0/1)
    ddp: bool = False
    params: list[nn.Parameter] = field(default_factory=list)
    autocast: torch.dtype | None = None      # run forward under torch.autocast in this dtype (mixed precision)
    reduce_dtype: torch.dtype | None = None  # manual_grad_sync: all-reduce gradients cast to this dtype
    sync_last_only: bool = False             # FSDP2 reduce-scatters and reshards on the last micro-batch only
    experts: list[nn.Parameter] = field(default_factory=list)   # expert parallelism: this rank's experts (their
                                                                 # gradients finished by hand after backward)
    expert_group: object | None = None       # their data-parallel group (dp / ep ranks) where averaged by hand
    ep: int = 1
    expert_mesh: object | None = None        # where they sit in the whole model's tensors (Experts.whole)

    @property
    def dense_params(self) -> list[nn.Parameter]:
        """The parameters a manual sync averages over dp: all but the experts."""
        if not self.experts:
            return self.params
        mine = {id(p) for p in self.experts}
        return [p for p in self.params if id(p) not in mine]


@dataclass(frozen=True, kw_only=True)
class Experts:
    """Expert parallelism's part of wrapping (executor.expert_parallel): the blocks' `experts` modules on this rank,
    the mesh of the dp / ep ranks holding the same experts (None where that is one rank), ep, and the mesh their
    tensors are placed on in the whole model's (expert_parallel.whole_expert)."""

    modules: list[nn.Module]
    mesh: object | None
    ep: int
    whole: object

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]


def wrap(modules: list[nn.Module], *, zero: int, pp: int, dp_mesh, optimizer_fn: OptimizerFn,
         unit_groups: list[list[nn.Module]] | None = None, tp: int = 1, compute: torch.dtype | None = None,
         distributed_optimizer: bool = False, experts: Experts | None = None) -> Wrapped:
    """_wrap, and with expert parallelism the experts' part: FSDP2 shards them over their group (ZeRO-2/3 or the
    distributed optimizer, with a group of two or more), else their gradients are averaged over it by hand; either
    way then scaled by 1 / ep, to the global loss's gradient (executor.expert_parallel). FSDP2's own divide factor
    would do the scaling in its reduce-scatter, but it reduces with PREMUL_SUM, which gloo does not have."""
    if experts is None:
        return _wrap(modules, zero=zero, pp=pp, dp_mesh=dp_mesh, optimizer_fn=optimizer_fn, unit_groups=unit_groups,
                     tp=tp, compute=compute, distributed_optimizer=distributed_optimizer)
    by_fsdp = (zero >= 2 or distributed_optimizer) and experts.mesh is not None
    if by_fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        reduce = torch.float32 if distributed_optimizer else compute   # as _wrap reduces the dense ones
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce) if compute else MixedPrecisionPolicy()
        for m in experts.modules:
            fully_shard(m, mesh=experts.mesh, reshard_after_forward=zero == 3, mp_policy=mp)  # type: ignore[arg-type]
    wrapped = _wrap(modules, zero=zero, pp=pp, dp_mesh=dp_mesh, optimizer_fn=optimizer_fn, unit_groups=unit_groups,
                    tp=tp, compute=compute, distributed_optimizer=distributed_optimizer,
                    ignored=None if by_fsdp else set(experts.params), no_ddp=True)
    wrapped.experts, wrapped.ep, wrapped.expert_mesh = experts.params, experts.ep, experts.whole
    if experts.mesh is not None and not by_fsdp:   # averaged by hand over it
        wrapped.expert_group = experts.mesh.get_group()  # type: ignore[attr-defined]
    if zero == 1 and not distributed_optimizer and experts.params:   # _wrap sharded the dense parameters' states
        # over dp; the experts' over their own group (a stage of dense layers only has none). The distributed
        # optimizer's one optimizer steps the experts too: FSDP2 shards them over that group, as ZeRO-2/3 does.
        group = wrapped.expert_group
        own = (_zero_sharded(experts.params, optimizer_fn, group, tp) if group is not None
               else optimizer_fn(experts.params))
        wrapped.optimizer = OptimizerPair(wrapped.optimizer, own)  # type: ignore[assignment]
    return wrapped


class OptimizerPair:
    """Two optimizers stepped as one: ZeRO-1 under expert parallelism, the dense parameters' states sharded over
    dp and the routed experts' over the ranks holding the same experts (dp / ep), as the estimate prices them
    (cost_models.cost.estimate._optimizer_pass). ZeroRedundancyOptimizer takes one process group, and its owner
    of an expert tensor would broadcast its own experts over every data-parallel rank's. What the executor asks of
    an optimizer: step, zero_grad, param_groups and state (local_bytes). Not a torch.optim.Optimizer: an LR
    scheduler takes each of `parts` (executor.api's module doc)."""

    def __init__(self, *parts: torch.optim.Optimizer) -> None:
        self.parts = parts

    def step(self, closure=None) -> None:
        if closure is not None:
            raise TypeError("OptimizerPair.step takes no closure: step each of .parts with it")
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]

    @property
    def state(self) -> dict:
        """Every part's per-parameter state (a ZeroRedundancyOptimizer's: its shard's, in .optim)."""
        return {k: v for part in self.parts for k, v in getattr(part, "optim", part).state.items()}

    @property
    def stands_for(self) -> dict:
        """Every part's stand-ins for tensor-parallel parameters (LocalShardZeRO.stands_for; checkpoints name the
        states by the model's parameters)."""
        return {k: v for part in self.parts for k, v in getattr(part, "stands_for", {}).items()}


def _wrap(modules: list[nn.Module], *, zero: int, pp: int, dp_mesh, optimizer_fn: OptimizerFn,
          unit_groups: list[list[nn.Module]] | None = None, tp: int = 1, compute: torch.dtype | None = None,
          distributed_optimizer: bool = False, ignored: set[nn.Parameter] | None = None,
          no_ddp: bool = False) -> Wrapped:
    """Apply the mapping to this rank's modules (pp = 1: the model itself; else its stages) and build the optimizer
    over its (local) parameters. `unit_groups` (pp = 1): the modules of each unit, sharded one FSDP2 group each.
    `tp` > 1: the modules are already split over the tp mesh (executor.tensor_parallel). `compute`: mixed
    precision's compute dtype (mixed_precision): FSDP2 casts for it, else Wrapped.autocast asks the caller to.
    `distributed_optimizer` (ZeRO-1, pp = 1): Megatron-LM's distributed optimizer on FSDP2 (the table above):
    gradients reduced in fp32, as Megatron-LM reduces bf16 training's (its grad buffer is fp32)."""
    dp = dp_mesh.size() if dp_mesh is not None else 1
    if dp == 1:
        params = [p for st in modules for p in st.parameters()]
        return Wrapped(modules=list(modules), optimizer=optimizer_fn(params), manual_grad_sync=False, params=params,
                       autocast=compute)
    group = dp_mesh.get_group()
    if zero >= 2 or distributed_optimizer:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        raf = zero == 3
        reduce = torch.float32 if distributed_optimizer else compute
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce) if compute else MixedPrecisionPolicy()
        shard = functools.partial(fully_shard, mp_policy=mp, ignored_params=ignored)
        if pp == 1:
            # One FSDP group per pipeline unit: gather one at a time, prefetch the next. A unit holding a parameter
            # shared with another unit (a tied embedding) is left to the root's group: FSDP2 would otherwise shard
            # the shared tensor twice and untie it.
            groups = [[m for m in g if any(True for _ in m.parameters())] for g in unit_groups or []]
            shared = _shared_param_ids(groups)
            for g in groups:
                if g and not any(id(p) in shared for m in g for p in m.parameters()):
                    shard(g if len(g) > 1 else g[0], mesh=dp_mesh, reshard_after_forward=raf)
        for st in modules:
            shard(st, mesh=dp_mesh, reshard_after_forward=raf)
        params = [p for st in modules for p in st.parameters()]
        return Wrapped(modules=list(modules), optimizer=optimizer_fn(params), manual_grad_sync=False, params=params,
                       sync_last_only=distributed_optimizer)
    params = [p for st in modules for p in st.parameters()]
    if pp == 1 and tp == 1 and not no_ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddps = [DDP(st, process_group=group, gradient_as_bucket_view=True) for st in modules]
        if compute is not None:   # reduce in the compute dtype (mixed_precision)
            for d in ddps:
                d.register_comm_hook((group, compute), _low_precision_reduce)
        wrapped: list[nn.Module] = list(ddps)
        manual = False
    else:
        wrapped, manual = list(modules), True
    if zero == 1:   # the experts' states, where ignored, are wrap's to shard over their own group
        skip = {id(p) for p in ignored or ()}
        optimizer = _zero_sharded([p for p in params if id(p) not in skip], optimizer_fn, group, tp)
    else:
        optimizer = optimizer_fn(params)
    return Wrapped(modules=wrapped, optimizer=optimizer, manual_grad_sync=manual, ddp=not manual, params=params,
                   autocast=compute, reduce_dtype=compute)


def _zero_sharded(params: list[nn.Parameter], optimizer_fn: OptimizerFn, group, tp: int) -> torch.optim.Optimizer:
    """ZeroRedundancyOptimizer over `group` (ZeRO-1) of optimizer_fn's optimizer class and settings."""
    template = optimizer_fn([nn.Parameter(torch.zeros(1))])
    accepted = inspect.signature(type(template).__init__).parameters
    # an optimizer's defaults can hold derived entries its constructor does not take (AdamW's decoupled_weight_decay):
    # pass on only what the constructor accepts
    kwargs = {k: v for k, v in template.defaults.items() if k in accepted}
    return _zero_optimizer(tp)(params, optimizer_class=type(template), process_group=group, **kwargs)


def _zero_optimizer(tp: int) -> type:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return local_shard_zero() if tp > 1 else ZeroRedundancyOptimizer


@functools.cache
def local_shard_zero() -> type:
    """The LocalShardZeRO class (built on first use: importing torch.distributed.optim costs a second)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class LocalShardZeRO(ZeroRedundancyOptimizer):
        """ZeRO-1 over the local shards of tensor-parallel (DTensor) parameters: each DTensor parameter is stood for
        by a plain parameter sharing its local tensor's storage (`shards`), so ZeroRedundancyOptimizer's updates and
        broadcasts land in the DTensor. Gradients are linked to the stand-ins before each step. `stands_for`: id of
        a stand-in -> the model's parameter (checkpoints name optimizer state by the model's parameter)."""

        def __init__(self, params, **kwargs) -> None:
            self.shards = [(p, _stand_in(p)) for p in params]
            self.stands_for = {id(q): p for p, q in self.shards}
            super().__init__([q for _, q in self.shards], **kwargs)

        def step(self, closure=None, **kwargs):
            for p, q in self.shards:
                if q is not p:
                    q.grad = None if p.grad is None else _local(p.grad)
            return super().step(closure, **kwargs)

        def zero_grad(self, set_to_none: bool = True) -> None:
            for p, q in self.shards:
                for t in (p, q):
                    if t.grad is not None and set_to_none:
                        t.grad = None
                    elif t.grad is not None:
                        t.grad.zero_()
    return LocalShardZeRO


def _stand_in(p: nn.Parameter) -> nn.Parameter:
    """A plain parameter on the storage of DTensor `p`'s local tensor (`p` itself when it is plain)."""
    if not hasattr(p, "to_local"):
        return p
    # a DTensor (hasattr above; its stubs are torch.Tensor's): to_local is a view of its storage, so updates through
    # the stand-in are the parameter's
    local = p.detach().to_local()  # type: ignore[attr-defined]
    return nn.Parameter(local, requires_grad=p.requires_grad)



def _shared_param_ids(groups: list[list[nn.Module]]) -> set[int]:
    seen: dict[int, int] = {}
    shared = set()
    for i, g in enumerate(groups):
        for p in (p for m in g for p in m.parameters()):
            if seen.setdefault(id(p), i) != i:
                shared.add(id(p))
    return shared


def _low_precision_reduce(state, bucket):
    """A DDP communication hook (state: (group, dtype)): all-reduce the bucket's gradients cast to dtype (their
    mean), then copy them back. torch's bf16_compress_hook does the same but refuses anything but NCCL >= 2.10
    (torch 2.13), gloo included."""
    group, dtype = state
    low = bucket.buffer().to(dtype).div_(dist.get_world_size(group))
    future = dist.all_reduce(low, group=group, async_op=True).get_future()

    def back(fut):
        out = bucket.buffer()
        out.copy_(fut.value()[0])
        return out
    return future.then(back)


def all_reduce_grads(params: list[nn.Parameter], group, dtype: torch.dtype | None = None) -> None:
    """Average gradients over the data-parallel group (the pipelined ZeRO-0/1 mapping), in `dtype` if given."""
    for p in params:
        if p.grad is not None:   # a tensor-parallel gradient: its local shard (the dp peers hold the same slice)
            grad = _local(p.grad)
            if dtype is None or grad.dtype == dtype:
                dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=group)
            else:
                low = grad.to(dtype)
                dist.all_reduce(low, op=dist.ReduceOp.AVG, group=group)
                grad.copy_(low)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_bytes(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes this rank holds, counted from its local tensors."""
    seen: set[int] = set()
    p_bytes = g_bytes = 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        lp = _local(p)
        p_bytes += lp.numel() * lp.element_size()
        if p.grad is not None:
            lg = _local(p.grad)
            g_bytes += lg.numel() * lg.element_size()
    opt = getattr(optimizer, "optim", optimizer)   # ZeroRedundancyOptimizer keeps its shard's optimizer in .optim
    o_bytes = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:   # per-parameter tensors, not the scalar step count
                lv = _local(v)
                o_bytes += lv.numel() * lv.element_size()
    return p_bytes, g_bytes, o_bytes
