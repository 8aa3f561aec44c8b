"""Sequence parallelism that saves the shard (Strategy.sp_save_shard), as Megatron-LM does.

Under sequence parallelism a region's input (attention's, the MLP's) and a vocabulary-split head's input arrive as
sequence shards and are all-gathered before their column-split linears, which save the gathered input for their
weight gradients: b x s x h per region, tp times the shard. Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", section 4.2.2) store only the shard and all-gather it again in backward:
one more all-gather of the same full buffer per region and backward, 2 s b h (1 - 1/tp) bytes fewer per layer in
16-bit.

Here each such module gets a forward pre-hook (ahead of its parallel style's) that gathers its input itself and,
for the module's forward, a torch.autograd.graph.saved_tensors_hooks context: a saved tensor that is a view of the
gathered input is kept as the shard plus the view's geometry, and gathered again the first time backward asks for
it (q, k and v share one gather; it is dropped after the last of them). Everything else passes to the hooks below
(the activation meter's), and the shard is handed to them in place of the gathered input, so a measured step counts
the shard. Inside torch.utils.checkpoint (full recompute of the unit), or on a module whose own forward is
checkpointed (activations.RECOMPUTED: a unit part), nothing is done: the unit keeps only its input. Schedules that
split the backward (zero-bubble: input gradients, then weight gradients with the graph retained) would unpack and
gather each input twice; Strategy refuses them with this option.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from cost_models.torch_compat.torch_private import checkpoint_hooks, storage_id, top_saved_tensor_hooks
from executor.activations import RECOMPUTED

_OPEN: list["_ShardSaver | None"] = []   # the contexts of the modules running forward, innermost last


def with_input(args: tuple, kwargs: dict, fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[tuple, dict]:
    """(args, kwargs) with the module's input replaced by fn(input): the first positional tensor, else
    `hidden_states` or the first tensor keyword (transformers' attention is called with keywords only)."""
    if args and isinstance(args[0], torch.Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    tensors = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    key = "hidden_states" if "hidden_states" in kwargs else (tensors[0] if tensors else None)
    if key is not None:
        kwargs = {**kwargs, key: fn(kwargs[key])}
    return args, kwargs


class _Shared:
    """One gathered input's shard, and its gathered copy while backward still needs it."""

    def __init__(self, shard, gathered) -> None:
        self.shard = shard                      # the input as it arrived: a Shard(1) DTensor
        self.shape, self.stride = gathered.shape, gathered.stride()
        self.offset = gathered.to_local().storage_offset()
        self.full: torch.Tensor | None = None   # the local gathered tensor, between first and last unpack
        self.waiting = 0                        # saves not yet unpacked

    def gathered_local(self) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate
        if self.full is None:
            with torch.no_grad():
                whole = DTensor.from_local(self.shard.to_local(), self.shard.device_mesh, self.shard.placements,
                                           run_check=False, shape=self.shape, stride=self.stride)
                self.full = whole.redistribute(self.shard.device_mesh, (Replicate(),)).to_local().contiguous()
        return self.full


class _Saved:
    """What autograd keeps for one saved view of a gathered input: the shared shard, the view's geometry, and the
    hooks below's handle of the shard (so they count it)."""

    __slots__ = ("shared", "size", "stride", "offset", "placements", "gshape", "gstride", "below", "unpacked")

    def __init__(self, shared: _Shared, t, below: Any) -> None:
        local = t.to_local()
        self.shared, self.below, self.unpacked = shared, below, False
        self.size, self.stride, self.offset = local.size(), local.stride(), local.storage_offset() - shared.offset
        self.placements, self.gshape, self.gstride = t.placements, t.shape, t.stride()
        shared.waiting += 1

    def tensor(self):
        from torch.distributed.tensor import DTensor
        s = self.shared
        full = s.gathered_local()
        view = full.as_strided(self.size, self.stride, full.storage_offset() + self.offset)
        if not self.unpacked:   # a second unpack (a retained graph) gathers again rather than keep `full` for it
            self.unpacked = True
            s.waiting -= 1
        if s.waiting == 0:
            s.full = None
        return DTensor.from_local(view, s.shard.device_mesh, self.placements, run_check=False, shape=self.gshape,
                                  stride=self.gstride)


class _Passed:
    """A saved tensor handed to the hooks below (`handle`: what their pack returned)."""

    __slots__ = ("handle",)

    def __init__(self, handle: Any) -> None:
        self.handle = handle


class _ShardSaver:
    """The saved-tensor hooks of one module's forward (module doc)."""

    def __init__(self, shard, gathered) -> None:
        self.key = storage_id(gathered.to_local())
        self.shared = _Shared(shard, gathered)
        self.below = top_saved_tensor_hooks()
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        if hasattr(t, "to_local") and storage_id(t.to_local()) == self.key:
            shard = self.shared.shard
            return _Saved(self.shared, t, self.below[0](shard) if self.below else None)
        return _Passed(self.below[0](t)) if self.below else t

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Saved):
            return packed.tensor()
        return self.below[1](packed.handle) if isinstance(packed, _Passed) else packed


def install(module: nn.Module, mesh) -> None:
    """Gather `module`'s sequence-sharded input in a pre-hook that runs before its parallel style's (which then
    finds it gathered), and save views of it as the shard during the module's forward (module doc)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        saver: list[_ShardSaver] = []

        def gather(x: torch.Tensor) -> torch.Tensor:
            shard = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (Shard(1),), run_check=False)
            if shard.placements != (Shard(1),):
                return x
            whole = shard.redistribute(mesh, (Replicate(),))
            if (mod not in RECOMPUTED and not checkpoint_hooks(top_saved_tensor_hooks())
                    and whole.to_local().is_contiguous()):
                saver.append(_ShardSaver(shard, whole))
            return whole
        args, kwargs = with_input(args, kwargs, gather)
        _OPEN.append(saver[0] if saver else None)
        if saver:
            saver[0].ctx.__enter__()
        return args, kwargs

    def after(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        saver = _OPEN.pop() if _OPEN else None
        if saver is not None:
            saver.ctx.__exit__(None, None, None)
        return output

    module.register_forward_pre_hook(before, with_kwargs=True, prepend=True)
    module.register_forward_hook(after, with_kwargs=True, always_call=True)
