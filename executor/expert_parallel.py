"""Expert parallelism on torch.distributed: each mixture-of-experts block's routed experts split over an EP group of
ep data-parallel ranks (cost_models.cost.moe's layout: ep consecutive dp ranks, torchtitan's), tokens dispatched to
the ranks holding their experts with all_to_all_single (uneven splits) and combined back, dropless: every
token-expert pair runs, so the loss is the one process's.

The block is the shape cost_models.profiling.moe recognises (a router and `experts` called as experts(hidden,
top_k_index, top_k_weights)), so the cut is at the `experts` call and the experts' own forward runs the local
experts: after dispatch each received row goes to its local expert as a routing of one expert with weight 1, and
the router's weights are applied on the sending rank after combine (as GShard combines: Lepikhin et al. 2021,
section 2.2). The stacked expert weights (every parameter of `experts` has the experts as its first dimension, as
transformers' and the zoo's do) keep this rank's E / ep rows.

Gradients: a local expert's gradient sums what every rank of its EP group sent it (the all-to-all's backward). The
global loss is the mean over dp ranks of their losses, so its gradient is that sum over the dp / ep ranks holding
the same experts, divided by dp: averaged over that group (by hand, or by FSDP2 sharding them over it) and scaled
by 1 / ep (sync_expert_grads).

Checkpoints hold the whole model's expert tensors (all E experts; whole_expert places this rank's rows in them),
so a checkpoint written under one ep resumes under any other, or without expert parallelism, and `planner export`
reads whole tensors as for a dense model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cost_models.profiling.moe import moe_blocks
from cost_models.records.errors import ConfigError


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with its gradient: the backward sends each row's gradient back the way it came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (recv, send), group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        recv, send = ctx.splits
        out = grad.new_empty((sum(send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send, recv, group=ctx.group)
        return out, None, None, None


class Dispatch:
    """The `experts` call of one block under expert parallelism (module doc): `forward` is the experts' own,
    running this rank's E / ep experts."""

    def __init__(self, experts: nn.Module, n_experts: int, ep: int, group) -> None:
        self.experts, self.forward = experts, experts.forward
        self.n_experts, self.ep, self.group = n_experts, ep, group
        # token-expert rows this rank's experts were sent, per call, while counting (routed_rows): a run counts
        # one step, and a loop that never asks (executor.api) keeps nothing
        self.received: list[int] | None = None

    def dtype(self) -> torch.dtype:
        return next(self.experts.parameters()).dtype

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k, local = top_k_index.shape[-1], self.n_experts // self.ep
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts)
        # how many rows each rank sends this one, per local expert: [source rank, local expert]
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=self.group)
        incoming = incoming.view(self.ep, local)
        send, recv = counts.view(self.ep, local).sum(1).tolist(), incoming.sum(1).tolist()
        if self.received is not None:
            self.received.append(sum(recv))
        got = _AllToAll.apply(hidden[order // k], recv, send, self.group)
        # received rows come source by source, each source's by expert: regroup them by local expert
        expert = torch.repeat_interleave(torch.arange(local, device=flat.device).repeat(self.ep), incoming.reshape(-1))
        by_expert = torch.argsort(expert, stable=True)
        rows = got[by_expert].to(self.dtype())   # the experts' compute dtype (mixed precision may cast them)
        ones = torch.ones((rows.shape[0], 1), dtype=rows.dtype, device=rows.device)
        y = self.forward(rows, expert[by_expert].unsqueeze(-1), ones)[torch.argsort(by_expert)].to(hidden.dtype)
        back = _AllToAll.apply(y, send, recv, self.group)
        weights = top_k_weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)
        # each token's k weighted rows back in token order (a gather by the inverse permutation), summed: backward
        # keeps the index alone, where index_add would keep the weighted rows too (its source's gradient is
        # expanded to the source)
        weighted = (back * weights)[torch.argsort(order)]
        return weighted.view(-1, k, hidden.shape[-1]).sum(1)


def shard_experts(model: nn.Module, *, ep: int, ep_rank: int, group) -> list[nn.Parameter]:
    """Keep this rank's E / ep experts of every block (real tensors, as the whole model was built on every rank)
    and route each block's `experts` call through Dispatch; returns the expert parameters (one-line ConfigError
    for a model without MoE blocks, experts not divisible by ep, or expert weights not stacked by expert)."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ConfigError(f"ep = {ep} splits routed experts, and this model has no mixture-of-experts blocks")
    out: list[nn.Parameter] = []
    for b in blocks:
        if b.n_experts % ep:
            raise ConfigError(f"ep = {ep} does not divide the {b.n_experts} experts of {b.name}")
        local = b.n_experts // ep
        own = list(b.experts.named_parameters(recurse=False))
        if len(own) != len(list(b.experts.parameters())) or any(p.shape[0] != b.n_experts for _, p in own):
            raise ConfigError(f"{b.name}.experts does not stack its experts' weights on a first dimension of "
                              f"{b.n_experts}; expert parallelism splits stacked weights only")
        for name, p in own:
            kept = nn.Parameter(p.detach()[ep_rank * local:(ep_rank + 1) * local].clone(),
                                requires_grad=p.requires_grad)
            setattr(b.experts, name, kept)
            out.append(kept)
        setattr(b.experts, "num_experts", local)   # its own forward routes over the local experts
        b.experts.forward = Dispatch(b.experts, b.n_experts, ep, group)
    return out


def whole_expert(t: torch.Tensor, param: torch.Tensor, *, mesh, ep: int) -> torch.Tensor:
    """An expert parameter of this rank, or an optimizer state of its shape, as a DTensor of the whole model's
    tensor, aliasing `t`'s storage (executor.checkpoint loads in place): Shard(0) over the EP group (`mesh` (ep,)),
    and where FSDP2 shards the experts over the dp / ep ranks holding the same ones, Shard(0) again over those
    (`mesh` (ep, edp): DTensor splits over the mesh's dimensions left to right, the EP rank's rows first). A step
    count (a scalar) is returned as it is; a state of another shape (a factored optimizer's) would be saved under
    one key with each EP rank's different data, so it is refused in one line."""
    from torch.distributed.tensor import DTensor, Shard
    if t.dim() == 0:
        return t
    if t.shape != param.shape:
        raise ConfigError(f"an optimizer state of shape {list(t.shape)} for expert parameters of shape "
                          f"{list(param.shape)}: expert-parallel checkpoints place only states shaped as their "
                          f"parameter (Adam's, AdamW's, SGD's); use such an optimizer, or ep = 1")
    local = t.to_local() if isinstance(t, DTensor) else t
    shape = torch.Size((param.shape[0] * ep, *param.shape[1:]))
    return DTensor.from_local(local, mesh, [Shard(0)] * mesh.ndim, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def routed_rows(model: nn.Module | None, held: list[nn.Module], *,
                count: bool | None = None) -> dict[str, tuple[int, ...]]:
    """Block name in `model` -> token-expert rows this rank's experts were sent per call while counting (a
    micro-batch's forward; a recomputed forward is another call), for the blocks the `held` modules run; `count`
    True starts counting afresh, False stops (None: as it was)."""
    mine = {id(m) for h in held for m in h.modules()}
    out = {}
    for name, m in model.named_modules() if model is not None else ():
        dispatch = getattr(m, "forward", None)
        if isinstance(dispatch, Dispatch) and id(m) in mine:
            out[name.removesuffix(".experts")] = tuple(dispatch.received or ())
            if count is not None:
                dispatch.received = [] if count else None
    return out


def sync_expert_grads(params: list[nn.Parameter], group, ep: int, dtype: torch.dtype | None = None) -> None:
    """The experts' gradients as the global loss's (module doc): averaged over the dp / ep ranks holding the same
    experts (`group`, in `dtype` as the dense ones are: executor.zero.all_reduce_grads; None when that is this rank
    alone or FSDP2 averaged them), then divided by ep (a DTensor shard's gradient divides locally)."""
    from executor.zero import all_reduce_grads
    if group is not None:
        all_reduce_grads(params, group, dtype)
    for p in params:
        if p.grad is not None:
            p.grad.div_(ep)
