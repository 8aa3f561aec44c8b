"""Profile a torch model unit by unit: parameters, FLOPs, boundary bytes, saved-for-backward bytes, and times.

How (each unit is measured alone, on the exact input it receives inside the whole model):
 1. one forward of the whole model, with forward pre-hooks that record the order modules run in and capture
    each candidate module's (args, kwargs);
 2. the units: the model's largest nn.ModuleList gives one unit per element; the modules that run before it form
    the embedding unit, those after it the head unit (or the user lists units by module name);
 3. each unit's modules run alone on their captured inputs (float inputs made leaves that require grad, so the
    backward includes the input gradient a pipeline stage must send back) under
    torch.utils.flop_counter.FlopCounterMode for FLOPs and torch.autograd.graph.saved_tensors_hooks for the bytes
    kept for backward, deduplicated by storage, parameters and buffers excluded;
 4. in real mode, once every unit is counted, forward and backward are timed (warm-up, then the median of
    repeats, with min and max); step 3's run of each unit, timed too, says how long step 4 will take;
 5. in real mode, the whole model's forward, loss and backward timed end to end, over the units' sum: a unit
    timed alone, again and again, finds its weights and inputs in cache, as it does not inside the model
    (ModelProfile.in_model_factor).
The last unit is run with the training loss attached, because an LM's loss keeps float logits for backward.

Meta mode builds the model on the meta device: exact counts and bytes for models of any size, no weights, no times.
On meta, SDPA would fall to the math path and store the s x s score matrix that no fused kernel keeps; the
profiler substitutes torch's fused CPU flash kernel (which has meta support) so meta and real profiles agree.
"""
from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from collections import OrderedDict
from typing import Any, Callable, cast

import psutil
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from cost_models.records.errors import ConfigError, ProfileError
from cost_models.records.formatting import fixed, now_utc
from cost_models.torch_compat.host import keep_freed_memory
from cost_models.models.losses import compute_loss, loss_kind, synthetic_target
from cost_models.models.source import DTYPES, ModelSource, input_spec, source_input_kind
from cost_models.torch_compat.optimizers import time_optimizers
from cost_models.models.pipelining import pipeline_support
from cost_models.records.profile import ModelProfile, SharedParam, Timing, TPUnit, UnitEdge, UnitProfile
from cost_models.records.tensor_parallel import TPRule, enters_late, rules_for, style_of
from cost_models.models.tp_shape import tp_shape
from cost_models.torch_compat.torch_private import (CPU_FLASH_ATTENTION, CPU_FLASH_ATTENTION_BACKWARD,
                                                    pipelining_split_backward, storage_id, tree_leaves, tree_map,
                                                    view_base)

ProgressFn = Callable[[int, int, str], None]

# torch's FlopCounterMode has no formula for the CPU flash-attention kernels, so it would count attention as 0.
# They compute the same products as the CUDA kernels; reuse torch's own SDPA formulas (4*b*s^2*h forward).
def _cpu_flash_fwd_flop(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q, k, v)


def _cpu_flash_bwd_flop(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, q, k, v)


_FLOP_MAPPING = {
    CPU_FLASH_ATTENTION: _cpu_flash_fwd_flop,
    CPU_FLASH_ATTENTION_BACKWARD: _cpu_flash_bwd_flop,
}
_ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


class _FusedAttentionOnMeta(TorchFunctionMode):
    """On meta tensors, run F.scaled_dot_product_attention through the fused CPU flash kernel, not the math path."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            extra = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), args[3:]), **kwargs)
            # The CPU flash kernel takes grouped-query K/V (fewer heads) natively, as enable_gqa asks.
            if q.is_meta and extra.get("attn_mask") is None and (q.shape[1] == k.shape[1] or extra.get("enable_gqa")):
                return CPU_FLASH_ATTENTION(q, k, v, extra.get("dropout_p", 0.0), bool(extra.get("is_causal", False)),
                                           scale=extra.get("scale"))[0]
        return func(*args, **kwargs)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Capture:
    """Hooks that record module call order, the first call's inputs of each watched module, the storages of
    its outputs (to find which unit's output feeds which unit: the data-flow edges), and, read off the running
    FLOP counter, the forward FLOPs of that call (known before any unit is measured: the progress weights)."""

    def __init__(self, modules: dict[str, nn.Module], counter: FlopCounterMode) -> None:
        self.order: list[str] = []
        self.inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self.outputs: dict[str, set[int]] = {}
        self.fwd_flops: dict[str, int] = {}
        self._flops_before: dict[str, int] = {}
        self._counter = counter
        self.keep_alive: list[torch.Tensor] = []
        self.handles = [m.register_forward_pre_hook(self._pre(name), with_kwargs=True) for name, m in modules.items()]
        self.handles += [m.register_forward_hook(self._post(name)) for name, m in modules.items()]

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            if name not in self.inputs:
                self.order.append(name)
                self.inputs[name] = (args, kwargs)
                self._flops_before[name] = self._counter.get_total_flops()
        return hook

    def _post(self, name: str):
        def hook(module, args, output):
            if name not in self.outputs:
                tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
                self.outputs[name] = {storage_id(t) for t in tensors}
                self.keep_alive.extend(tensors)  # a freed storage's address could be reused: hold them all
                self.fwd_flops[name] = self._counter.get_total_flops() - self._flops_before.get(name, 0)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# --- what tensor parallelism splits (ModelProfile.tensor_parallel's plan, applied to the unit's module tree) ---------

_SPLIT_LINEAR = ("colwise", "rowwise")
# role of a tensor saved inside a module of each style (TPUnit's doc); region: see _TPWatch.role
_ROLE_OF_STYLE = {"colwise": "col_input", "head": "col_input", "rowwise": "split", "norm": "seq"}
_TP_COUNTS = ("split_flops", "vocab_flops", "core_flops", "row_bytes", "row_calls",
              "region_bytes", "region_calls", "repl_region_bytes", "repl_region_calls", "entry_bytes", "entry_calls",
              "embed_bytes", "embed_calls", "whole_embed_bytes", "whole_embed_calls", "input_bytes", "input_calls",
              "head_in_bytes", "logit_bytes", "head_calls")
_ROLES = ("split", "seq", "col_input", "core")


class _Frame:
    """A running module with a TP style: its style, whether it holds split linears (a region), whether a rowwise
    linear inside it has already run (what follows is on the residual stream), and FLOPs at its start."""

    def __init__(self, style: str, holds_split: bool, flops_kind: str | None, flops_at: int) -> None:
        self.style, self.holds_split, self.flops_kind, self.flops_at = style, holds_split, flops_kind, flops_at
        self.after_rowwise = False


def _first_float(args, kwargs) -> torch.Tensor | None:
    """The module's activation input: its first floating-point tensor argument."""
    for t in list(args) + list(kwargs.values()):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t
    return None


def _tensors_bytes(out) -> int:
    return sum(_nbytes(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))


class _TPWatch(TorchFunctionMode):
    """Forward pre/post hooks on the styled modules of one unit module (beside the profiler's saved_tensors_hooks):
    the innermost running styled module gives each saved tensor its role (TPUnit), styled modules' inputs and
    outputs give the TP collective buffers, and the running FLOP counter the FLOPs inside split modules. As a
    torch-function mode it marks F.scaled_dot_product_attention: what SDPA saves beyond q, k and v is the attention
    core (Korthikanti et al. 2022, section 5: what selective recompute drops)."""

    def __init__(self, module: nn.Module, prefix: str, rules: tuple[TPRule, ...], counter: FlopCounterMode,
                 seq_len: int) -> None:
        super().__init__()
        self.counts = dict.fromkeys(_TP_COUNTS + tuple(f"saved_{r}" for r in _ROLES), 0)
        self.stack: list[_Frame] = []
        self.core_inputs: set[int] | None = None
        self.core_saved: dict[int, bool] = {}   # storage -> first saved by the attention core
        self.counter, self.seq_len = counter, seq_len
        self.late_entry = enters_late(rules)   # the embedding's output stays whole under SP (an sp_input follows)
        styled = {n: r.style for n, m in module.named_modules(prefix=prefix) if (r := style_of(n, rules))}
        self.handles = []
        for name, sub in module.named_modules(prefix=prefix):
            if name in styled:
                holds = any(st in _SPLIT_LINEAR for n, st in styled.items() if n.startswith(name + "."))
                self.handles.append(sub.register_forward_pre_hook(self._pre(styled[name], holds), with_kwargs=True))
                self.handles.append(sub.register_forward_hook(self._post(), always_call=True))

    def _add(self, key: str, size: int) -> None:
        self.counts[f"{key}_bytes"] += size
        self.counts[f"{key}_calls"] += 1

    def _pre(self, style: str, holds_split: bool):
        def hook(module, args, kwargs):
            first = _first_float(args, kwargs)
            size = _nbytes(first) if first is not None else 0
            if style == "region":
                self._add("region" if holds_split else "repl_region", size)
            elif style == "sp_input":
                self._add("input", size)
            elif style == "head":
                self.counts["head_in_bytes"] += size
                self.counts["head_calls"] += 1
            kind = ("split" if style in _SPLIT_LINEAR or (style == "region" and holds_split)
                    else "vocab" if style == "head" else None)
            if any(f.flops_kind for f in self.stack):   # FLOPs are counted once, at the outermost split module
                kind = None
            self.stack.append(_Frame(style, holds_split, kind, self.counter.get_total_flops()))
        return hook

    def _post(self):
        def hook(module, args, output):
            frame = self.stack.pop()
            if frame.flops_kind:
                self.counts[f"{frame.flops_kind}_flops"] += self.counter.get_total_flops() - frame.flops_at
            size = _tensors_bytes(output)
            if frame.style == "rowwise":
                self._add("row", size)
                for f in reversed(self.stack):
                    if f.style == "region":
                        f.after_rowwise = True
                        break
            elif frame.style == "embedding":
                self._add("whole_embed" if self.late_entry else "embed", size)
            elif frame.style == "sp_entry":
                self._add("entry", size)
            elif frame.style == "head":
                self.counts["logit_bytes"] += size
        return hook

    def role(self, t: torch.Tensor) -> str | None:
        """The role of a tensor saved now (None: it stays whole)."""
        if self.core_inputs is not None:   # inside SDPA: q, k and v are the region's, the rest is the core
            return "split" if storage_id(t) in self.core_inputs else "core"
        if not self.stack:
            return None
        f = self.stack[-1]
        if f.style != "region":
            return _ROLE_OF_STYLE.get(f.style)
        if not f.holds_split:
            return None
        if f.after_rowwise:
            return "seq"
        # an unfused attention's s x s scores, probabilities and their dropout (Korthikanti's 5as^2b term; torch's
        # matmul saves them as (b*a, s, s) views); ambiguous only where the head size equals the sequence length
        if t.dim() >= 3 and t.shape[-1] == t.shape[-2] == self.seq_len:
            return "core"
        return "split"

    def save(self, t: torch.Tensor, nbytes: int) -> None:
        role = self.role(t)
        self.core_saved[storage_id(t)] = role == "core"
        if role:
            self.counts[f"saved_{role}"] += nbytes

    def resave(self, t: torch.Tensor, nbytes: int) -> None:
        """A storage saved again: if the core saved it first and an op outside the core saves it too (the CPU flash
        kernel's output is laid out so that the following transpose + reshape is a view, kept by the output
        projection), selective recompute cannot drop it: it moves to the later saver's role."""
        key = storage_id(t)
        if not self.core_saved.get(key):
            return
        role = self.role(t)
        if role != "core":
            self.core_saved[key] = False
            self.counts["saved_core"] -= nbytes
            if role:
                self.counts[f"saved_{role}"] += nbytes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self.core_inputs is not None:
            return func(*args, **kwargs)
        qkv = list(args[:3]) + [kwargs[k] for k in ("query", "key", "value") if k in kwargs]
        self.core_inputs = {storage_id(t) for t in qkv if isinstance(t, torch.Tensor)}
        start = self.counter.get_total_flops()
        try:
            return func(*args, **kwargs)
        finally:
            self.counts["core_flops"] += self.counter.get_total_flops() - start
            self.core_inputs = None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _param_split(pname: str, rules: tuple[TPRule, ...]) -> int:
    """0 whole, 1 split by tp, 2 split with the vocabulary (TPUnit.param_split): a rowwise linear's bias is added
    after the reduction and stays whole (Shoeybi et al. 2019, section 3; torch's RowwiseParallel replicates it)."""
    owner, _, leaf = pname.rpartition(".")
    rule = style_of(owner, rules)
    if rule is None or rule.style not in ("colwise", "rowwise", "embedding", "head"):
        return 0
    if rule.style in ("embedding", "head"):
        return 2
    return 0 if rule.style == "rowwise" and leaf != "weight" else 1


def _in_norm(pname: str, rules: tuple[TPRule, ...]) -> bool:
    """A parameter of a norm-style module: replicated, its gradient all-reduced over tp under SP."""
    rule = style_of(pname.rpartition(".")[0], rules)
    return rule is not None and rule.style == "norm"


def _tp_unit(numels: list[int], splits: list[int], norms: list[bool], results: list["_ModuleResult"]) -> TPUnit:
    counts = {k: sum(r.tp.get(k, 0) for r in results) for k in results[0].tp} if results[0].tp else {}
    return TPUnit(param_split=tuple(splits), split_params=sum(n for n, f in zip(numels, splits) if f == 1),
                  vocab_params=sum(n for n, f in zip(numels, splits) if f == 2),
                  norm_params=sum(n for n, f in zip(numels, norms) if f), norm_tensors=sum(norms), **counts)


def model_tp_rules(model: nn.Module) -> tuple[TPRule, ...] | None:
    """The rules the profiler measures against: the model's plan with the vocabulary split (whether it splits at a
    given tp is the cost model's question, vocab_divides), or None for a model without a plan."""
    shape = tp_shape(model)
    return None if shape.refusal else rules_for(shape.tp_plan, vocab_split=True)


def _largest_module_list(model: nn.Module) -> str:
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ProfileError("the model has no nn.ModuleList to take pipeline units from; pass --units with module names")
    def size(item):
        return (sum(p.numel() for p in item[1].parameters()), len(item[1]))
    return max(lists, key=size)[0]


def _path_siblings(model: nn.Module, list_name: str) -> list[str]:
    """Modules next to the block list along its path from the root: candidates for the embedding and head units."""
    parts = list_name.split(".")
    siblings: list[str] = []
    for depth in range(len(parts)):
        parent_name = ".".join(parts[:depth])
        parent = model.get_submodule(parent_name)
        for child_name, _ in parent.named_children():
            if child_name != parts[depth]:
                siblings.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return siblings


def _parse_units(spec: str | list[str], model: nn.Module) -> list[tuple[str, tuple[str, ...]]]:
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not items:
        raise ConfigError("--units is empty; give comma-separated module names, '+' joining modules of one unit")
    names = {n for n, _ in model.named_modules() if n}
    units, seen = [], set()
    for item in items:
        mods = tuple(m.strip() for m in item.split("+"))
        for m in mods:
            if m not in names:
                raise ConfigError(f"--units: the model has no module '{m}'")
            if m in seen:
                raise ConfigError(f"--units: module '{m}' appears in two units")
            seen.add(m)
        units.append((item, mods))
    return units


def _block_names(model: nn.Module, list_name: str) -> list[str]:
    """The module names of the blocks in `list_name`, the nn.ModuleList _largest_module_list found."""
    return [f"{list_name}.{i}" for i in range(len(cast(nn.ModuleList, model.get_submodule(list_name))))]


def _derive_units(model: nn.Module, list_name: str, order: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    blocks = _block_names(model, list_name)
    pos = {name: i for i, name in enumerate(order)}
    missing = [b for b in blocks if b not in pos]
    if missing:
        raise ProfileError(f"block {missing[0]} never ran in the forward pass; pass --units with the modules that run")
    first, last = pos[blocks[0]], pos[blocks[-1]]
    siblings = [s for s in _path_siblings(model, list_name) if s in pos]
    before = tuple(sorted((s for s in siblings if pos[s] < first), key=pos.__getitem__))
    after = tuple(sorted((s for s in siblings if pos[s] > last), key=pos.__getitem__))
    units = []
    if before:
        units.append((before[0] if len(before) == 1 else "embed", before))
    units += [(b, (b,)) for b in blocks]
    if after:
        units.append((after[0] if len(after) == 1 else "head", after))
    return units


def _counts_gqa() -> bool:
    """Whether torch's SDPA FLOP formula takes grouped-query K/V (fewer heads than the query): torch 2.13's does;
    torch 2.11's asserts 'query/key/value shapes are incompatible' (seen profiling HF Llama, Mistral and Qwen2 on
    an H200 with torch 2.11)."""
    try:
        sdpa_flop_count((1, 4, 2, 8), (1, 2, 2, 8), (1, 2, 2, 8))
    except AssertionError:
        return False
    return True


COUNTS_GQA = _counts_gqa()


class _ExpandGQA(TorchFunctionMode):
    """For a torch whose FLOP formulas refuse grouped-query attention: give SDPA K/V repeated to the query's heads,
    which computes the same attention with the same FLOPs as the formulas count them where they take GQA. The
    counting pass then saves the repeated K/V: on such a torch a GQA model's saved bytes count K/V at the query's
    head count (an overestimate of that share)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention and len(args) >= 3:
            q, k, v = args[:3]
            if k.shape[-3] != q.shape[-3] and q.shape[-3] % k.shape[-3] == 0:
                rep = q.shape[-3] // k.shape[-3]
                kwargs.pop("enable_gqa", None)
                args = (q, k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3), *args[3:7])
        return func(*args, **kwargs)


class _FlopCounter(FlopCounterMode):
    """FlopCounterMode with this module's formulas, repeating grouped-query K/V where torch cannot count them."""

    def __init__(self, expand_gqa: bool) -> None:
        super().__init__(display=False, custom_mapping=_FLOP_MAPPING)
        self._expand = _ExpandGQA() if expand_gqa else None

    def __enter__(self):
        if self._expand:
            self._expand.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._expand:
                self._expand.__exit__(*exc)


def _flop_counter() -> FlopCounterMode:
    return _FlopCounter(expand_gqa=not COUNTS_GQA)


def _attention_ops(fc: FlopCounterMode) -> set[str]:
    return {str(op) for op in fc.get_flop_counts().get("Global", {}) if any(k in str(op) for k in _ATTENTION_OPS)}


class _ModuleResult:
    def __init__(self) -> None:
        self.fwd_flops = self.bwd_flops = self.output_bytes = self.saved_bytes = self.split_kept_bytes = 0
        self.split_after_bytes: int | None = None   # _split_kept_in_stages; None: as split_kept_bytes
        self.split_suffix_bytes: int | None = None
        self.saved_fixed_bytes = 0                  # _saved_fixed
        self.saved_other_bytes = 0                  # of saved_bytes, storages not in the model's float dtype
        self.saved_other_fixed_bytes = 0            # of saved_fixed_bytes, the same (_saved_fixed)
        self.transient_bytes = 0                    # _count_module, on GPUs
        self.fwd_times: list[float] = []
        self.bwd_times: list[float] = []
        self.fwd_times_one: list[float] = []   # the same with a micro-batch of one sample
        self.bwd_times_one: list[float] = []
        self.attention: set[str] = set()
        self.tp: dict[str, int] = {}              # _TPWatch.counts (empty for a model without a TP plan)
        self.target: torch.Tensor | None = None   # the last unit's synthetic loss target, reused by its timed runs


def _fresh(captured):
    """The captured inputs as new leaves (float tensors require grad, as a stage's received activations do)."""
    def leaf(t):
        if isinstance(t, torch.Tensor):
            return t.detach().requires_grad_(t.is_floating_point())
        return t
    return tree_map(leaf, captured)


def _roots(out, loss: str | None, target):
    if loss is not None:
        return [compute_loss(loss, out, target)]
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def _sync() -> None:
    """Wait for queued GPU kernels, so a host clock times them (CUDA launches are asynchronous); nothing on CPU."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _time_module(module: nn.Module, captured, loss: str | None, target, warmup: int,
                 repeats: int, tick: Callable[[], None]) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of each repeat after `warmup` untimed runs; `tick()` after every run."""
    fwd, bwd = [], []
    for i in range(warmup + repeats):
        args, kwargs = _fresh(captured)
        _sync()
        t0 = time.perf_counter()
        roots = _roots(module(*args, **kwargs), loss, target)
        _sync()
        t1 = time.perf_counter()
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
        _sync()
        t2 = time.perf_counter()
        module.zero_grad(set_to_none=True)
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        tick()
    return fwd, bwd


def _one_sample(captured, batch: int):
    """The captured inputs cut to the first sample (tensors whose leading dimension is the batch)."""
    return tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch else t,
                    captured)


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
    sample = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, _one_sample(captured, batch))
    one = _count_module(module, sample, excluded=excluded, loss=loss, dtype=dtype)

    def fixed(at_batch: int, at_one: int) -> int:
        return max(0, min(at_batch, round((batch * at_one - at_batch) / (batch - 1))))
    fixed_all, fixed_other = fixed(saved, one.saved_bytes), fixed(other, one.saved_other_bytes)
    # parts of parts (profile.UnitProfile, validate): other's fixed part within the fixed bytes, its growing part
    # within the growing bytes; rounding and noise in either count must not break that
    return fixed_all, min(max(fixed_other, other - saved + fixed_all), other, fixed_all)


def _count_module(module: nn.Module, captured: tuple[tuple[Any, ...], dict[str, Any]], *, excluded: set[int],
                  loss: str | None, name: str = "", rules: tuple[TPRule, ...] | None = None,
                  seq_len: int = 0, batch: int = 1, dtype: torch.dtype | None = None) -> _ModuleResult:
    """Run one module alone on its captured input, forward and backward once: FLOPs, saved bytes, output bytes
    (and, for the last unit, the synthetic loss target its timed runs reuse); with the model's TP rules, what
    tensor parallelism splits (_TPWatch; `name` is the module's name in the model, which the rules match). Saved
    storages not in `dtype`, the model's (token ids, masks, fp32 statistics), are counted apart too."""
    res = _ModuleResult()
    saved: dict[int, int] = {}
    other: dict[int, int] = {}
    watch: list[_TPWatch] = []

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

    args, kwargs = _fresh(captured)
    on_gpu = any(isinstance(t, torch.Tensor) and t.is_cuda for t in tree_leaves(captured))
    if on_gpu:   # the allocator's peak over this forward + backward (transient_bytes below)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        fwd_fc = stack.enter_context(_flop_counter())
        if rules is not None:
            watch.append(stack.enter_context(_TPWatch(module, name, rules, fwd_fc, seq_len)))
            stack.callback(watch[0].remove)
        out = module(*args, **kwargs)
        res.target = synthetic_target(loss, out) if loss is not None else None
        roots = _roots(out, loss, res.target)
    res.tp = watch[0].counts if watch else {}
    res.output_bytes = sum(_nbytes(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    res.saved_bytes = sum(saved.values())
    res.saved_other_bytes = sum(other.values())
    res.fwd_flops = fwd_fc.get_total_flops()
    with _flop_counter() as bwd_fc:
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
    res.bwd_flops = bwd_fc.get_total_flops()
    res.attention = _attention_ops(fwd_fc) | _attention_ops(bwd_fc)
    if on_gpu:
        grads = sum(_nbytes(p.grad) for p in module.parameters() if p.grad is not None)
        peak = torch.cuda.max_memory_allocated() - base
        res.transient_bytes = max(0, peak - res.saved_bytes - res.output_bytes - grads)
    del out, roots
    module.zero_grad(set_to_none=True)
    # after this count's backward: a second count on one sample, not two graphs alive at once
    res.saved_fixed_bytes, res.saved_other_fixed_bytes = _saved_fixed(
        module, captured, res.saved_bytes, res.saved_other_bytes, batch=batch, excluded=excluded, loss=loss, dtype=dtype)
    res.split_kept_bytes = _kept_after_split(module, module, captured, excluded, loss, res.target)
    return res


class _Chain(nn.Module):
    """Units in a row, each fed the one before's output and called with its own captured keyword arguments."""

    def __init__(self, modules: list[nn.Module], kwargs: list[dict[str, Any]]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)
        self.part_kwargs = kwargs

    def forward(self, *args, **kwargs):
        x = self.parts[0](*args, **kwargs)
        for module, kw in zip(self.parts[1:], self.part_kwargs[1:]):
            x = module(x, **kw)
        return x


SUFFIXES_MEASURED = 4   # last-stage starts measured exactly; earlier ones extrapolated (a chain of like blocks)


def _split_kept_in_stages(model: nn.Module, unit_defs, capture: _Capture, results_by_unit, *, excluded: set[int],
                          loss: str | None) -> None:
    """Set what torch's split backward keeps per micro-batch of a stage that starts at each unit (_kept_after_split
    on the chain of units): split_after_bytes for a unit after the one before it in a middle stage (the pair less
    the first), split_suffix_bytes for a last stage starting there (the chain to the loss). Which nodes sit on no
    weight's path depends on what is up- and downstream (gpt-tiny: a block alone keeps its attention kernel's
    tensors, also its GELU's input when another block follows; mlp-deep's blocks keep nothing in a middle stage and
    their GELU's input in a last stage), hence measured in context. The last SUFFIXES_MEASURED starts are measured,
    earlier ones extrapolated by the last measured step. Where the units do not chain (a module's one positional
    input is not the previous module's output) a unit keeps its alone value."""
    n = len(unit_defs)
    spans: list[tuple[int, int]] = []                    # unit -> its modules' range in flat
    flat: list[tuple[nn.Module, dict[str, Any]]] = []    # (module, its captured kwargs)
    for _, mods, _ in results_by_unit:
        spans.append((len(flat), len(flat) + len(mods)))
        flat += [(model.get_submodule(m), _fresh(((), capture.inputs[m][1]))[1]) for m in mods]
    names = [m for _, mods, _ in results_by_unit for m in mods]
    fed = [j > 0 and _feeds(capture, names[j - 1], names[j]) for j in range(len(flat))]

    def chain(a: int, b: int) -> _Chain | None:   # units a..b as one module, if they chain
        lo, hi = spans[a][0], spans[b][1]
        return _Chain([m for m, _ in flat[lo:hi]], [k for _, k in flat[lo:hi]]) if all(fed[lo + 1:hi]) else None

    def kept(a: int, b: int, with_loss: bool) -> int | None:
        run = chain(a, b)
        target = results_by_unit[-1][2][-1].target if with_loss else None
        return None if run is None else _kept_after_split(run, run, capture.inputs[names[spans[a][0]]], excluded,
                                                          loss if with_loss else None, target)
    for i in range(1, n):
        pair = kept(i - 1, i, False) if fed[spans[i][0]] else None
        if pair is not None:
            results_by_unit[i][2][0].split_after_bytes = max(0, pair - results_by_unit[i - 1][2][0].split_kept_bytes)
    suffix: dict[int, int] = {}
    for a in range(n - 1, 0, -1):
        if a + 1 < n and not fed[spans[a + 1][0]]:
            break                    # the chain to the last unit ends here
        if n - a > SUFFIXES_MEASURED and a + 2 in suffix:
            suffix[a] = max(0, 2 * suffix[a + 1] - suffix[a + 2])
        else:
            value = kept(a, n - 1, True)
            if value is None:
                break
            suffix[a] = value
    for a, value in suffix.items():
        results_by_unit[a][2][0].split_suffix_bytes = value


def _feeds(capture: _Capture, prev: str, name: str) -> bool:
    """Module `name`'s one positional input is module `prev`'s output."""
    args, _ = capture.inputs[name]
    return (len(args) == 1 and isinstance(args[0], torch.Tensor)
            and storage_id(args[0]) in capture.outputs.get(prev, ()))


_SPLIT_MEMO: dict[tuple, int] = {}   # _kept_after_split by _split_signature, per profile run (_measure_units)


def _split_signature(module: nn.Module, captured, loss: str | None) -> tuple:
    """What _kept_after_split depends on: the modules' classes and parameter shapes, the input shapes and the loss
    (a model's repeated blocks share one measurement: 80 layers are measured once, not 80 times)."""
    parts = list(module.parts) if isinstance(module, _Chain) else [module]
    shapes = tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tree_leaves(captured)
                   if isinstance(t, torch.Tensor))
    return (tuple((type(m).__qualname__, tuple((n, tuple(p.shape)) for n, p in m.named_parameters())) for m in parts),
            shapes, loss)


def _kept_after_split(run: Callable, module: nn.Module, captured, excluded: set[int], loss: str | None, target) -> int:
    key = _split_signature(module, captured, loss)
    if key not in _SPLIT_MEMO:
        _SPLIT_MEMO[key] = _measure_kept_after_split(run, module, captured, excluded, loss, target)
    return _SPLIT_MEMO[key]


def _measure_kept_after_split(run: Callable, module: nn.Module, captured, excluded: set[int], loss: str | None,
                              target) -> int:
    """Bytes of the saved tensors of run(*captured) that torch's split backward leaves alive while the output is
    still held. The input gradient (I) runs autograd.grad with retain_graph=True and the weight gradient (W) starts
    from the intermediates I kept, so the saved tensors of nodes on no weight's path (the attention kernel's, the
    loss's log-softmax, an activation function's between two units) are freed only with the graph
    (torch.distributed.pipelining._backward: stage_backward_input, stage_backward_weight), which a stage holds to the
    end of the step (measured: executor.activations). 0 when the input needs no gradient (a first stage runs one
    full backward at W)."""
    counts: dict[int, int] = {}
    sizes: dict[int, int] = {}

    class Held:
        __slots__ = ("key", "tensor")

        def __init__(self, key: int, tensor: torch.Tensor) -> None:
            self.key, self.tensor = key, tensor
            counts[key] = counts.get(key, 0) + 1

        def __del__(self) -> None:
            counts[self.key] -= 1

    def pack(t: torch.Tensor):
        key = storage_id(t)
        if key in excluded:
            return t
        sizes[key] = t.untyped_storage().nbytes()
        return Held(key, t)

    args, kwargs = _fresh(captured)
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    params = [p for p in module.parameters() if p.requires_grad]
    if not inputs or not params:
        return 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.tensor if isinstance(h, Held) else h):
        out = run(*args, **kwargs)
        # torch detaches the stage's outputs in place after I: a view (an output that reshapes) gets a copy
        roots = [r if view_base(r) is None else r.clone() for r in _roots(out, loss, target)]
    if not roots:
        return 0
    grads = None if loss is not None else [torch.ones_like(r) for r in roots]
    split_backward_input, split_backward_weight = pipelining_split_backward()
    dinputs, groups = split_backward_input(roots, grads, inputs, iter(params))
    split_backward_weight(iter(params), groups, retain_graph=False)
    del dinputs, groups
    kept = sum(sizes[k] for k, n in counts.items() if n > 0)
    del out, roots
    module.zero_grad(set_to_none=True)
    return kept


def _time_into(res: _ModuleResult, module: nn.Module, captured, *, loss: str | None, warmup: int, repeats: int,
               batch: int, tick: Callable[[float], None]) -> None:
    """Forward and backward times at the profile's micro-batch and, when that is larger, at one sample, so time
    can be modelled as a + b * batch (fixed per-call overhead plus per-sample work) rather than proportional to the
    batch. `tick(share)` after every run: 1 for a run at the micro-batch, 1 / batch for one on one sample."""
    res.fwd_times, res.bwd_times = _time_module(module, captured, loss, res.target, warmup, repeats, lambda: tick(1.0))
    if batch > 1:
        target = res.target[:1] if res.target is not None else None
        res.fwd_times_one, res.bwd_times_one = _time_module(module, _one_sample(captured, batch), loss, target, warmup,
                                                            repeats, lambda: tick(1 / batch))


def _timing(per_module: list[list[float]]) -> Timing:
    """Unit time = sum over its modules; median, min and max are taken per module and summed."""
    return Timing(median_s=sum(statistics.median(t) for t in per_module), min_s=sum(min(t) for t in per_module),
                  max_s=sum(max(t) for t in per_module), repeats=len(per_module[0]))


UnitResults = list[tuple[str, tuple[str, ...], list[_ModuleResult]]]


class _Progress:
    """Progress as a share of the expected time, reported as (done, total) parts with a total fixed from the start.

    Units differ in size (an embedding lookup against a block's matmuls, a head with a large vocabulary's loss),
    so a count of units gives a wrong time estimate. Work goes in two passes: every module is first run once,
    forward and backward, to count FLOPs and bytes; then (real mode) timed, (warmup + repeats) runs at the
    micro-batch and as many on one sample. The counting pass is weighted by forward FLOPs (known from the
    whole-model forward before it) and given its share of the time: one run of each module against the timed
    runs, so 1 / (1 + runs). It also measures each module's forward + backward in seconds, which weighs the timed
    runs and says how long they will take. FLOPs alone mislead there: the counter misses the loss, and CPU bf16
    backward runs far below the forward's FLOP rate: from the whole-model forward the timed runs of a CPU bf16
    profile were predicted at a small fraction of what they took, from the counting pass's seconds within a few
    percent (measured: benchmarks/results/measurements.md, "Profiler progress estimate")."""

    TOTAL = 1_000_000

    def __init__(self, flops: dict[str, int], *, timed: bool, warmup: int, repeats: int, batch: int,
                 on_progress: ProgressFn | None) -> None:
        # modules without matmuls (lookups, norms) still move the bar: at least 1% of the mean module's FLOPs
        floor = max(1, sum(flops.values()) // max(1, len(flops)) // 100)
        self.weight = {m: max(f, floor) for m, f in flops.items()}
        # timed runs per module in units of one run at the micro-batch (a one-sample run counts 1 / batch)
        self.runs = (warmup + repeats) * (1 + (1 / batch if batch > 1 else 0)) if timed else 0.0
        self.counting_share = 1 / (1 + self.runs)
        self.seconds: dict[str, float] = {}
        self._report, self._counted, self._timed, self._timed_total = on_progress, 0.0, 0.0, 0.0
        self.name = ""

    def _emit(self) -> None:
        if self._report:
            share = self.counting_share * self._counted / sum(self.weight.values())
            if self._timed_total:
                share += (1 - self.counting_share) * self._timed / self._timed_total
            self._report(min(self.TOTAL, round(share * self.TOTAL)), self.TOTAL, self.name)

    def unit(self, name: str) -> None:
        self.name = name
        self._emit()

    def counted(self, module: str, seconds: float) -> None:
        self._counted += self.weight[module]
        self.seconds[module] = seconds
        self._emit()

    def timing_starts(self) -> float:
        """Seconds the timed runs should take, from the counting pass's forward + backward of each module."""
        self._timed_total = sum(self.seconds.values()) * self.runs
        return self._timed_total

    def tick(self, module: str, share: float) -> None:
        self._timed += self.seconds[module] * share
        self._emit()

    def done(self) -> None:
        self.name, self._counted, self._timed = "done", sum(self.weight.values()), self._timed_total
        self._emit()


def _measure_units(model: nn.Module, inputs: tuple[torch.Tensor, ...], model_name: str, units, *, excluded: set[int],
                   loss: str, timed: bool, warmup: int, repeats: int, rules: tuple[TPRule, ...] | None,
                   seq_len: int, on_progress: ProgressFn | None,
                   on_estimate: Callable[[float], None] | None,
                   ) -> tuple[UnitResults, int, set[str], tuple["UnitEdge", ...], float]:
    """Find the units (steps 1-2 of the module doc), then measure each of their modules alone: all counted
    (step 3), then, in real mode, all timed (step 4). `on_estimate(seconds)`, in real mode, gets the time the
    timed runs should take, between the two passes."""
    explicit = _parse_units(units, model) if units else None
    if explicit:
        watched = {m: model.get_submodule(m) for _, mods in explicit for m in mods}
    else:
        list_name = _largest_module_list(model)
        names = _path_siblings(model, list_name) + _block_names(model, list_name)
        watched = {n: model.get_submodule(n) for n in names}
    model_fc = _flop_counter()
    capture = _Capture(watched, model_fc)
    try:
        with torch.no_grad(), model_fc:
            model(*inputs)
    except Exception as exc:
        raise ProfileError(f"the forward pass of {model_name} failed: {type(exc).__name__}: {exc}") from None
    finally:
        capture.remove()
    unit_defs = explicit or _derive_units(model, list_name, capture.order)
    for name, mods in unit_defs:
        for m in mods:
            if m not in capture.inputs:
                raise ProfileError(f"unit '{name}': module '{m}' never ran in the forward pass")
    edges = _data_flow_edges(unit_defs, capture)

    batch = inputs[0].shape[0]
    progress = _Progress({m: capture.fwd_flops.get(m, 0) for _, mods in unit_defs for m in mods}, timed=timed,
                         warmup=warmup, repeats=repeats, batch=batch, on_progress=on_progress)
    last = unit_defs[-1][1][-1]
    _SPLIT_MEMO.clear()
    results_by_unit: UnitResults = []
    attention: set[str] = set(_attention_ops(model_fc))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    for name, mods in unit_defs:
        progress.unit(f"counting {name}")
        results = []
        for m in mods:
            t0 = time.perf_counter()
            results.append(_count_module(model.get_submodule(m), capture.inputs[m], excluded=excluded, batch=batch,
                                         loss=loss if m == last else None, name=m, rules=rules, seq_len=seq_len,
                                         dtype=dtype))
            progress.counted(m, time.perf_counter() - t0)
            attention |= results[-1].attention
        results_by_unit.append((name, mods, results))
    _split_kept_in_stages(model, unit_defs, capture, results_by_unit, excluded=excluded, loss=loss)
    in_model = 1.0
    if timed:
        seconds = progress.timing_starts()
        if on_estimate:
            on_estimate(seconds)
        in_model = _time_units(model, inputs, results_by_unit, capture, progress, loss=loss, last=last, batch=batch,
                               warmup=warmup, repeats=repeats)
    progress.done()
    return results_by_unit, model_fc.get_total_flops(), attention, edges, in_model


def _time_units(model: nn.Module, inputs: tuple[torch.Tensor, ...], results_by_unit: "UnitResults", capture: _Capture,
                progress: "_Progress", *, loss: str, last: str, batch: int, warmup: int, repeats: int) -> float:
    """Step 4 of the module doc into each module's result, then step 5: the whole model's in_model_factor."""
    for name, mods, results in results_by_unit:
        progress.unit(f"timing {name}")
        for m, res in zip(mods, results):
            _time_into(res, model.get_submodule(m), capture.inputs[m], loss=loss if m == last else None,
                       warmup=warmup, repeats=repeats, batch=batch, tick=functools.partial(progress.tick, m))
    progress.unit("timing the whole model")
    return _in_model_factor(model, inputs, results_by_unit, loss=loss, warmup=warmup, repeats=repeats)


def _in_model_factor(model: nn.Module, inputs: tuple[torch.Tensor, ...], results_by_unit: "UnitResults", *,
                     loss: str, warmup: int, repeats: int) -> float:
    """The whole model's forward, loss and backward, timed end to end (median of repeats), over the sum of its
    units' medians (ModelProfile.in_model_factor). 1.0 where the model's output is neither a tensor nor has
    .logits (no loss to take here)."""
    target = results_by_unit[-1][2][-1].target
    units_s = sum(statistics.median(r.fwd_times) + statistics.median(r.bwd_times)
                  for _, _, results in results_by_unit for r in results)
    whole = _whole_model_seconds(model, inputs, target, loss=loss, warmup=warmup, repeats=repeats)
    return whole / units_s if whole and units_s > 0 else 1.0


def _whole_model_seconds(model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor | None, *,
                         loss: str, warmup: int, repeats: int, autocast: torch.dtype | None = None) -> float | None:
    """Median seconds of the whole model's forward, loss and backward (forward under torch.autocast in `autocast`
    if given); None where there is no target or the output is neither a tensor nor has .logits (no loss here)."""

    class _Logits(nn.Module):   # the loss is taken on an output object's .logits (transformers' causal LMs)
        def forward(self, *args):
            cast = torch.autocast(args[0].device.type, dtype=autocast) if autocast else contextlib.nullcontext()
            with cast:
                out = model(*args)
            return out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if target is None:
        return None
    with torch.no_grad():
        if not isinstance(_Logits()(*inputs), torch.Tensor):
            return None
    fwd, bwd = _time_module(_Logits(), (inputs, {}), loss, target, warmup, repeats, lambda: None)
    model.zero_grad(set_to_none=True)
    return statistics.median([f + b for f, b in zip(fwd, bwd)])


def _mixed_factor(source: ModelSource, model: nn.Module, inputs: tuple[torch.Tensor, ...], target, *, loss: str,
                  warmup: int, repeats: int) -> float:
    """ModelProfile.mixed_factor: the model built in fp32 under autocast to bf16 (torch's mixed precision, as the
    executor runs bf16-mixed on GPUs), over the bf16 model, each timed whole: a plan priced from plain bf16 unit
    times ran far slower under autocast (measured on an H200: benchmarks/results/measurements.md, "GPU
    observations").
    1.0 where either cannot be timed, or the fp32 copy does not fit beside the bf16 model."""
    plain = _whole_model_seconds(model, inputs, target, loss=loss, warmup=warmup, repeats=repeats)
    if not plain:
        return 1.0
    master: nn.Module | None = None   # the fp32 copy, dropped before the cache is emptied
    try:
        master = source.build(device=inputs[0].device, dtype=torch.float32)
        master.train()
        mixed = _whole_model_seconds(master, inputs, target, loss=loss, warmup=warmup, repeats=repeats,
                                     autocast=torch.bfloat16)
    except torch.cuda.OutOfMemoryError:
        return 1.0
    finally:
        master = None
        torch.cuda.empty_cache()
    return mixed / plain if mixed else 1.0


def _data_flow_edges(unit_defs, capture: _Capture) -> tuple[UnitEdge, ...]:
    """(src unit, dst unit, bytes) for every tensor a unit's output hands to a later unit's input. A chain has
    only (i, i+1) edges; a skip connection across units shows as an edge that jumps."""
    producer: dict[int, int] = {}
    for i, (_, mods) in enumerate(unit_defs):
        for key in capture.outputs.get(mods[-1], ()):
            producer[key] = i
    found: dict[tuple[int, int], int] = {}
    for j, (_, mods) in enumerate(unit_defs):
        seen: set[int] = set()
        for m in mods:
            for t in tree_leaves(capture.inputs[m]):
                if not isinstance(t, torch.Tensor):
                    continue
                key = storage_id(t)
                src = producer.get(key)
                if src is not None and src < j and key not in seen:
                    seen.add(key)
                    found[src, j] = found.get((src, j), 0) + _nbytes(t)
    return tuple(UnitEdge(src=a, dst=b, bytes=n) for (a, b), n in sorted(found.items()))


def _real_device(device: str) -> str:
    """Where real mode runs: `auto` is the GPU when there is one (its times are what GPU ranks run at), else CPU,
    where this process then keeps freed blocks for reuse as CPU ranks do (host.keep_freed_memory)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no GPU here; use --device cpu, or --meta to count without timing")
    real = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    if real == "cpu":
        keep_freed_memory()
    return real


def _check_fits_in_memory(source: ModelSource, dtype: torch.dtype, device: str) -> None:
    meta_model = source.build(device="meta", dtype=dtype)
    param_bytes = sum(_nbytes(p) for p in meta_model.parameters())
    # parameters + gradients + a working margin of the same size: a floor, not an estimate of the activations.
    need = 3 * param_bytes
    avail = torch.cuda.mem_get_info()[0] if device == "cuda" else psutil.virtual_memory().available
    where = "the GPU" if device == "cuda" else "this machine"
    if need > avail:
        raise ProfileError(f"real-mode profiling of {source.name} needs about {fixed(need, 'GiB', 1)}, {where} has "
                           f"{fixed(avail, 'GiB', 1)} available; add --meta to profile it without weights")


def profile_model(source: ModelSource, *, micro_batch_size: int, seq_len: int, dtype: str = "fp32",
                  meta: bool = False, device: str = "auto", units: str | list[str] | None = None, warmup: int = 2,
                  repeats: int = 5, threads: int | None = None, command: str = "", on_progress: ProgressFn | None = None,
                  on_estimate: Callable[[float], None] | None = None) -> ModelProfile:
    """Measure `source` at one micro-batch of (micro_batch_size, seq_len) and return its ModelProfile.

    `dtype` auto: fp32 on CPU (CPU ranks run every plan in fp32), bf16 on a GPU and in meta mode.
    `device` (real mode): auto (the GPU when torch sees one, else the CPU), cpu or cuda; a GPU profile records
    its device's name, and the planner uses its times for clusters of that GPU only (compute.uses_measured_times).
    `threads` sets torch's thread count while measuring (and restores it): real-mode times are only comparable
    with a run whose ranks use as many (executor CPU ranks use one). `on_progress(done, total, what)` reports the
    share of the expected time done (see _Progress: a constant total, done == total at the end);
    `on_estimate(seconds)`, in real mode, how long the timed runs will take, once the counting pass has measured
    one forward and backward of every unit (about 1 / (1 + 1.5 x (warmup + repeats)) of the work)."""
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _profile(source, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype, meta=meta,
                        device=device, units=units, warmup=warmup, repeats=repeats, command=command,
                        on_progress=on_progress, on_estimate=on_estimate)
    except torch.cuda.OutOfMemoryError:
        raise ProfileError(f"the GPU ran out of memory profiling {source.name} at micro-batch {micro_batch_size} x "
                           f"{seq_len}; use a smaller --micro-batch-size or --seq-len, --device cpu, or --meta to "
                           f"count without running") from None
    finally:
        torch.set_num_threads(previous)


def _profile(source: ModelSource, *, micro_batch_size: int, seq_len: int, dtype: str, meta: bool, device: str, units,
             warmup: int, repeats: int, command: str, on_progress: ProgressFn | None,
             on_estimate: Callable[[float], None] | None) -> ModelProfile:
    if micro_batch_size <= 0:
        raise ConfigError(f"--micro-batch-size must be positive, got {micro_batch_size}")
    if seq_len <= 0:
        raise ConfigError(f"--seq-len must be positive, got {seq_len}")
    if dtype not in DTYPES and dtype != "auto":
        raise ConfigError(f"--dtype must be auto or one of {', '.join(DTYPES)}, got {dtype}")
    if repeats < 1 or warmup < 0:
        raise ConfigError("--repeats must be >= 1 and --warmup >= 0")
    if device not in ("auto", "cpu", "cuda"):   # checked in meta mode too: a wrong --device is a mistake either way
        raise ConfigError(f"--device must be auto, cpu or cuda, got {device}")
    device = "meta" if meta else _real_device(device)
    # auto: what ranks will compute in: CPU ranks run every plan in fp32, GPUs (and meta profiles, which plan for
    # them) bf16
    dtype = ("fp32" if device == "cpu" else "bf16") if dtype == "auto" else dtype
    torch_dtype = DTYPES[dtype]
    if not meta:
        _check_fits_in_memory(source, torch_dtype, device)

    model = source.build(device=device, dtype=torch_dtype)
    model.train()
    inputs = source.example_input(model, micro_batch_size, seq_len, device)
    in_kind, vocab = source_input_kind(source, model, inputs, seq_len)
    loss = loss_kind(in_kind)
    excluded = {storage_id(t) for t in list(model.parameters()) + list(model.buffers())}

    with contextlib.ExitStack() as stack:
        stack.enter_context(source.forward_context())
        if meta:
            stack.enter_context(_FusedAttentionOnMeta())
        rules, load_before = model_tp_rules(model), os.getloadavg()[0]
        unit_results, model_fwd_flops, attention, edges, in_model = _measure_units(
            model, inputs, source.name, units, excluded=excluded, loss=loss, timed=not meta, warmup=warmup,
            repeats=repeats, rules=rules, seq_len=seq_len, on_progress=on_progress, on_estimate=on_estimate)
        mixed = 1.0
        if device == "cuda" and dtype == "bf16":
            mixed = _mixed_factor(source, model, inputs, unit_results[-1][2][-1].target, loss=loss, warmup=warmup,
                                  repeats=repeats)
    # the optimizer's step, timed on this device (compute.optimizer_step_time prices a rank's update from it)
    optimizers = () if meta else time_optimizers(model, torch.device(device), warmup=warmup, repeats=repeats)
    unit_profiles, shared = _account_params(model, unit_results, rules)
    # whether the executor can cut stages that compute what this forward computes (planner: else pp = 1 only)
    pipelining = pipeline_support(model, [(name, mods) for name, mods, _ in unit_results])
    total_params = sum(p.numel() for p in model.parameters())
    assigned = sum(u.params for u in unit_profiles)
    largest = max(unit_profiles, key=lambda u: (u.params, u.fwd_flops))
    return ModelProfile(
        name=source.name, source=source.ref, mode="meta" if meta else "real", dtype=dtype,
        micro_batch_size=micro_batch_size, seq_len=seq_len,
        input=input_spec(inputs, kind=in_kind, vocab_size=vocab), loss=loss, units=tuple(unit_profiles),
        total_params=total_params, total_param_bytes=sum(_nbytes(p) for p in model.parameters()),
        unassigned_params=total_params - assigned, shared=tuple(shared),
        model_fwd_flops=model_fwd_flops, attention_kernels=tuple(sorted(attention)), edges=edges, pipelining=pipelining,
        tensor_parallel=tp_shape(model), in_model_factor=in_model, mixed_factor=mixed, optimizer_timings=optimizers,
        largest_unit=largest.name, device="gpu" if device == "cuda" else device,
        device_name=torch.cuda.get_device_name() if device == "cuda" else "", threads=torch.get_num_threads(),
        torch_version=torch.__version__, command=command, created_at=now_utc(), **_load_record(load_before, meta),
    )


def _load_record(load_before: float, meta: bool) -> dict:
    """ModelProfile.load_1min and cpus: the load before and after the timed runs (none in meta mode)."""
    if meta:
        return {"load_1min": (), "cpus": 0}
    return {"load_1min": (round(load_before, 2), round(os.getloadavg()[0], 2)), "cpus": os.cpu_count() or 0}


def _account_params(model: nn.Module, unit_results,
                    rules: tuple[TPRule, ...] | None = None) -> tuple[list[UnitProfile], list[SharedParam]]:
    """Count each parameter once, in the first unit (in call order) that uses it; record tied ones as shared (and,
    with TP rules, how each counted tensor splits)."""
    owner: dict[int, tuple[str, str]] = {}            # id(param) -> (canonical name, owning unit)
    aliases: "OrderedDict[int, list[tuple[str, str]]]" = OrderedDict()
    profiles = []
    for name, mods, results in unit_results:
        params = pbytes = tensors = 0
        numels: list[int] = []
        splits: list[int] = []
        norms: list[bool] = []
        shared_here: list[str] = []
        for m in mods:
            for pname, p in model.get_submodule(m).named_parameters(prefix=m, remove_duplicate=False):
                if id(p) not in owner:
                    owner[id(p)] = (pname, name)
                    params += p.numel()
                    pbytes += _nbytes(p)
                    tensors += 1
                    numels.append(p.numel())
                    splits.append(_param_split(pname, rules) if rules is not None else 0)
                    norms.append(rules is not None and _in_norm(pname, rules))
                elif owner[id(p)][0] != pname:
                    shared_here.append(pname)
                    aliases.setdefault(id(p), []).append((pname, name))
        timed = bool(results[0].fwd_times)
        profiles.append(UnitProfile(
            name=name, modules=mods, params=params, param_bytes=pbytes, param_tensors=tensors,
            param_numels=tuple(numels),
            shared_params=tuple(shared_here),
            fwd_flops=sum(r.fwd_flops for r in results), bwd_flops=sum(r.bwd_flops for r in results),
            output_bytes=results[-1].output_bytes, saved_bytes=sum(r.saved_bytes for r in results),
            split_kept_bytes=sum(r.split_kept_bytes for r in results),
            split_after_bytes=(results[0].split_after_bytes if results[0].split_after_bytes is not None
                               else sum(r.split_kept_bytes for r in results)),
            split_suffix_bytes=results[0].split_suffix_bytes,
            saved_fixed_bytes=sum(r.saved_fixed_bytes for r in results),
            saved_other_dtype_bytes=sum(r.saved_other_bytes for r in results),
            saved_other_fixed_bytes=sum(r.saved_other_fixed_bytes for r in results),
            transient_bytes=max(r.transient_bytes for r in results),   # its modules run one after another
            fwd_time=_timing([r.fwd_times for r in results]) if timed else None,
            bwd_time=_timing([r.bwd_times for r in results]) if timed else None,
            fwd_time_one=_timing([r.fwd_times_one for r in results]) if timed and results[0].fwd_times_one else None,
            bwd_time_one=_timing([r.bwd_times_one for r in results]) if timed and results[0].bwd_times_one else None,
            tp=_tp_unit(numels, splits, norms, results) if rules is not None else None,
        ))
    numel = {id(p): p.numel() for p in model.parameters()}
    shared = [SharedParam(name=owner[pid][0], aliases=tuple(a for a, _ in al),
                          units=tuple(dict.fromkeys([owner[pid][1]] + [u for _, u in al])), numel=numel[pid])
              for pid, al in aliases.items()]
    return profiles, shared
