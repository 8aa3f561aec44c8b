"""What tensor parallelism splits, measured against ModelProfile.tensor_parallel's plan applied to a unit's module
tree: the rules the profiler measures against, the role of each tensor a unit saves, the TP collective buffers and
the FLOPs inside split modules, seen while the unit runs (TPWatch), and which of its parameters split."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from cost_models.models.tp_shape import tp_shape
from cost_models.profiling.tensors import tensor_bytes
from cost_models.records.tensor_parallel import TPRule, enters_late, rules_for, style_of
from cost_models.torch_compat.torch_private import storage_id, tree_leaves

_SPLIT_LINEAR = ("colwise", "rowwise")
# role of a tensor saved inside a module of each style (TPUnit's doc); region: see TPWatch.role
_ROLE_OF_STYLE = {"colwise": "col_input", "head": "col_input", "rowwise": "split", "norm": "seq",
                  "head_norm": "split"}
_TP_COUNTS = ("split_flops", "vocab_flops", "core_flops", "core_kv_bytes", "row_bytes", "row_calls",
              "region_bytes", "region_calls", "repl_region_bytes", "repl_region_calls", "entry_bytes", "entry_calls",
              "embed_bytes", "embed_calls", "whole_embed_bytes", "whole_embed_calls", "input_bytes", "input_calls",
              "head_in_bytes", "logit_bytes", "head_calls")
_ROLES = ("split", "seq", "col_input", "core", "logits")


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
    return sum(tensor_bytes(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))


class TPWatch(TorchFunctionMode):
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
        self.vocab = 0   # the last dimension of a vocabulary-split head's logits, once it has run
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
            size = tensor_bytes(first) if first is not None else 0
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
                self.vocab = output.shape[-1] if isinstance(output, torch.Tensor) else 0
        return hook

    def role(self, t: torch.Tensor) -> str | None:
        """The role of a tensor saved now (None: it stays whole)."""
        if self.core_inputs is not None:   # inside SDPA: q, k and v are the region's, the rest is the core
            return "split" if storage_id(t) in self.core_inputs else "core"
        if not self.stack:   # after a vocabulary-split head, the loss keeps its log-probabilities: split too
            return "logits" if self.vocab and t.dim() >= 1 and t.shape[-1] == self.vocab else None
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
        self.counts["core_kv_bytes"] += sum(tensor_bytes(t) for t in qkv[1:3] if isinstance(t, torch.Tensor))
        start = self.counter.get_total_flops()
        try:
            return func(*args, **kwargs)
        finally:
            self.counts["core_flops"] += self.counter.get_total_flops() - start
            self.core_inputs = None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def param_split(pname: str, rules: tuple[TPRule, ...]) -> int:
    """0 whole, 1 split by tp, 2 split with the vocabulary (TPUnit.param_split): a rowwise linear's bias is added
    after the reduction and stays whole (Shoeybi et al. 2019, section 3; torch's RowwiseParallel replicates it)."""
    owner, _, leaf = pname.rpartition(".")
    rule = style_of(owner, rules)
    if rule is None or rule.style not in ("colwise", "rowwise", "embedding", "head"):
        return 0
    if rule.style in ("embedding", "head"):
        return 2
    return 0 if rule.style == "rowwise" and leaf != "weight" else 1


def norm_style(pname: str, rules: tuple[TPRule, ...]) -> str:
    """"norm" for a parameter of a norm-style module (replicated, its gradient all-reduced over tp under SP),
    "head_norm" for a per-head norm's (all-reduced always), else ""."""
    rule = style_of(pname.rpartition(".")[0], rules)
    return rule.style if rule is not None and rule.style in ("norm", "head_norm") else ""


def model_tp_rules(model: nn.Module) -> tuple[TPRule, ...] | None:
    """The rules the profiler measures against: the model's plan with the vocabulary split (whether it splits at a
    given tp is the cost model's question, vocab_divides), or None for a model without a plan."""
    shape = tp_shape(model)
    return None if shape.refusal else rules_for(shape.tp_plan, vocab_split=True)
