"""The counting pass (step 3 of model_profiler's module doc): a module run alone on its captured input, forward and
backward once, for its FLOPs, output bytes, bytes saved for backward (deduplicated by storage, parameters and buffers
excluded; the part that does not grow with the batch; the part in another dtype than the model's), what tensor
parallelism splits (TPWatch) and what a split backward keeps; and ModuleResult, the record of one module that this
pass and the timed runs fill."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from cost_models.models.losses import synthetic_target
from cost_models.profiling.flops import attention_ops, flop_counter
from cost_models.profiling.split_backward import kept_after_split
from cost_models.profiling.tensors import backward_roots, fresh, one_sample, tensor_bytes
from cost_models.profiling.tp_watch import TPWatch
from cost_models.profiling.work_counter import WorkCounter
from cost_models.records.tensor_parallel import TPRule
from cost_models.records.work import WorkCounts
from cost_models.torch_compat.torch_private import storage_id, tree_leaves, tree_map


class ModuleResult:
    """What the counting pass and the timed runs find for one module of a unit."""

    def __init__(self) -> None:
        self.fwd_flops = self.bwd_flops = self.output_bytes = self.saved_bytes = self.split_kept_bytes = 0
        self.split_after_bytes: int | None = None   # split_backward.split_kept_in_stages; None: as split_kept_bytes
        self.split_suffix_bytes: int | None = None
        self.saved_fixed_bytes = 0                  # _saved_fixed
        self.saved_other_bytes = 0                  # of saved_bytes, storages not in the model's float dtype
        self.saved_other_fixed_bytes = 0            # of saved_fixed_bytes, the same (_saved_fixed)
        self.transient_bytes = 0                    # count_module, on GPUs
        self.fwd_work = self.bwd_work = WorkCounts()  # the passes' work by kind (profiling.work_counter)
        self.fwd_times: list[float] = []
        self.bwd_times: list[float] = []
        self.fwd_times_one: list[float] = []   # the same with a micro-batch of one sample
        self.bwd_times_one: list[float] = []
        self.attention: set[str] = set()
        self.tp: dict[str, int] = {}              # TPWatch.counts (empty for a model without a TP plan)
        self.target: torch.Tensor | None = None   # the last unit's synthetic loss target, reused by its timed runs


UnitResults = list[tuple[str, tuple[str, ...], list[ModuleResult]]]


def _saved_fixed(module: nn.Module, captured, saved: int, other: int, *, batch: int, excluded: set[int],
                 loss: str | None, dtype: torch.dtype | None) -> tuple[int, int]:
    """The part of `saved` (bytes saved at `batch` samples) that does not grow with the batch, and of that the part
    in another dtype than the model's (`other`: the same at `batch`): with `one` saved on one sample,
    saved = fixed + per_sample x batch gives fixed = (batch x one - saved) / (batch - 1). An embedding saves its
    position ids whatever the batch (gpt-wide: 512 bytes on one sample, 1,280 on four), which a stage holding only
    the embedding would mispredict by 60% at one sample. (0, 0) when the batch is one."""
    if batch <= 1:
        return 0, 0
    # a copy: a slice of the captured batch would count the batch's whole storage
    sample = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, one_sample(captured, batch))
    one = count_module(module, sample, excluded=excluded, loss=loss, dtype=dtype)

    def fixed(at_batch: int, at_one: int) -> int:
        return max(0, min(at_batch, round((batch * at_one - at_batch) / (batch - 1))))
    fixed_all, fixed_other = fixed(saved, one.saved_bytes), fixed(other, one.saved_other_bytes)
    # parts of parts (profile.UnitProfile, validate): other's fixed part within the fixed bytes, its growing part
    # within the growing bytes; rounding and noise in either count must not break that
    return fixed_all, min(max(fixed_other, other - saved + fixed_all), other, fixed_all)


def count_module(module: nn.Module, captured: tuple[tuple[Any, ...], dict[str, Any]], *, excluded: set[int],
                 loss: str | None, name: str = "", rules: tuple[TPRule, ...] | None = None,
                 seq_len: int = 0, batch: int = 1, dtype: torch.dtype | None = None) -> ModuleResult:
    """Run one module alone on its captured input, forward and backward once: FLOPs, saved bytes, output bytes
    (and, for the last unit, the synthetic loss target its timed runs reuse); with the model's TP rules, what
    tensor parallelism splits (TPWatch; `name` is the module's name in the model, which the rules match). Saved
    storages not in `dtype`, the model's (token ids, masks, fp32 statistics), are counted apart too."""
    res = ModuleResult()
    saved: dict[int, int] = {}
    other: dict[int, int] = {}
    watch: list[TPWatch] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_id(t)
        if key not in excluded and key not in saved:
            saved[key] = t.untyped_storage().nbytes()
            if dtype is not None and t.dtype != dtype:
                other[key] = saved[key]
            if watch:
                watch[0].save(t, saved[key])
        elif watch and key in saved:
            watch[0].resave(t, saved[key])
        return t

    args, kwargs = fresh(captured)
    on_gpu = any(isinstance(t, torch.Tensor) and t.is_cuda for t in tree_leaves(captured))
    if on_gpu:   # the allocator's peak over this forward + backward (transient_bytes below)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        fwd_fc = stack.enter_context(flop_counter())
        fwd_work = stack.enter_context(WorkCounter())
        if rules is not None:
            watch.append(stack.enter_context(TPWatch(module, name, rules, fwd_fc, seq_len)))
            stack.callback(watch[0].remove)
        out = module(*args, **kwargs)
        res.target = synthetic_target(loss, out) if loss is not None else None
        roots = backward_roots(out, loss, res.target)
    res.tp = watch[0].counts if watch else {}
    res.output_bytes = sum(tensor_bytes(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    res.saved_bytes, res.saved_other_bytes = sum(saved.values()), sum(other.values())
    with flop_counter() as bwd_fc, WorkCounter() as bwd_work:
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
    res.fwd_flops, res.bwd_flops = fwd_fc.get_total_flops(), bwd_fc.get_total_flops()
    res.fwd_work, res.bwd_work = fwd_work.counts(), bwd_work.counts()
    res.attention = attention_ops(fwd_fc) | attention_ops(bwd_fc)
    if on_gpu:
        grads = sum(tensor_bytes(p.grad) for p in module.parameters() if p.grad is not None)
        peak = torch.cuda.max_memory_allocated() - base
        res.transient_bytes = max(0, peak - res.saved_bytes - res.output_bytes - grads)
    del out, roots
    module.zero_grad(set_to_none=True)   # before the count on one sample: never two graphs alive at once
    res.saved_fixed_bytes, res.saved_other_fixed_bytes = _saved_fixed(
        module, captured, res.saved_bytes, res.saved_other_bytes, batch=batch, excluded=excluded, loss=loss,
        dtype=dtype)
    res.split_kept_bytes = kept_after_split(module, module, captured, excluded, loss, res.target)
    return res


def repeated(results_by_unit: UnitResults, calls: dict[str, int]) -> Iterator[tuple[ModuleResult, int]]:
    """(result, k) of each module the forward runs k > 1 times (Capture.calls)."""
    for _, mods, results in results_by_unit:
        for m, res in zip(mods, results):
            if calls.get(m, 1) > 1:
                yield res, calls[m]


def repeat_counts(results_by_unit: UnitResults, calls: dict[str, int]) -> None:
    """A module the forward runs k times (weight sharing across depth: ALBERT, a looped block) does its work and
    keeps its activations k times per step: its counts (measured on its first call) are scaled by k, in place,
    assuming every call sees inputs of the first one's shapes (what such loops do)."""
    for res, k in repeated(results_by_unit, calls):
        res.fwd_flops, res.bwd_flops = k * res.fwd_flops, k * res.bwd_flops
        res.saved_bytes, res.saved_fixed_bytes = k * res.saved_bytes, k * res.saved_fixed_bytes
        res.saved_other_bytes, res.saved_other_fixed_bytes = (k * res.saved_other_bytes,
                                                              k * res.saved_other_fixed_bytes)
        res.split_kept_bytes *= k
        res.split_after_bytes = None if res.split_after_bytes is None else k * res.split_after_bytes
        res.split_suffix_bytes = None if res.split_suffix_bytes is None else k * res.split_suffix_bytes
        res.tp = {key: k * value for key, value in res.tp.items()}   # TPWatch: bytes, calls, FLOPs, all sums
        fwd, bwd = res.fwd_work, res.bwd_work
        for _ in range(k - 1):
            res.fwd_work, res.bwd_work = res.fwd_work.plus(fwd), res.bwd_work.plus(bwd)
