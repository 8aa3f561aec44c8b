"""Which tensor-parallel plan fits a torch model, and the dimensions that decide its degrees (`planner profile`
records them as a TPShape): the built-in plan of the model's family, or a user's plan function (`--tp-plan
module:function`) checked against the model's modules. The plans themselves are data in
cost_models.records.tensor_parallel."""
from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import math
from typing import Any, Callable, Iterator

from cost_models.models.families import FAMILIES, HF_MODEL_TYPES, family_of
from cost_models.models.source import load_attr
from cost_models.records.errors import ConfigError
from cost_models.records.limits import check_fused_parts
from cost_models.records.tensor_parallel import (CUSTOM, CUSTOM_STYLES, SPLIT_STYLES, STYLE_KINDS, TPRule, TPShape,
                                                 style_of)


def tp_shape(model) -> TPShape:
    """Which plan fits this torch model and its dimensions (`planner profile` records it): the custom plan of
    `custom_tp_plan`'s context when one is active, else the built-in plan for the model's family."""
    custom = _CUSTOM_PLAN.get()
    if custom is not None:
        return custom_shape(model, _plan_rules(_called(custom[1], model, custom[0]), custom[0]), f"{CUSTOM}{custom[0]}")
    family = family_of(model)
    if family is not None:
        why = family.refusal(model)
        return TPShape(plan=f"no: {why}") if why else TPShape(plan=family.name, **family.dims(model))
    kind = getattr(getattr(model, "config", None), "model_type", None)
    own = "planner profile --tp-plan module:function gives one"
    if kind is not None:
        return TPShape(plan=f"no: no tensor-parallel plan for transformers' {kind} models yet "
                            f"({_listed(HF_MODEL_TYPES)} have one; {own})")
    zoo = [f.zoo_class.__name__ for f in FAMILIES if f.zoo_class is not None]
    return TPShape(plan=f"no: no tensor-parallel plan for {type(model).__name__} (the zoo's {_listed(zoo)} and "
                        f"transformers' {_listed(HF_MODEL_TYPES)} models have one; {own})")


def _listed(names) -> str:
    """'a, b and c'."""
    names = list(names)
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)


_CUSTOM_PLAN: contextvars.ContextVar[tuple[str, Callable[..., Any]] | None] = contextvars.ContextVar(
    "tp_plan", default=None)


@contextlib.contextmanager
def custom_tp_plan(ref: str | None) -> Iterator[None]:
    """Profile under a user's plan function (`planner profile --tp-plan module:function`): it takes the torch model
    and returns (pattern, style) or (pattern, style, parts) tuples or TPRules; tp_shape returns its validated rules.
    The function is imported here, before any profiling: a bad reference fails at once."""
    if ref is None:
        yield
        return
    token = _CUSTOM_PLAN.set((ref, load_attr(ref, "--tp-plan")))
    try:
        yield
    finally:
        _CUSTOM_PLAN.reset(token)


def _called(fn, model, ref: str):
    """The user's plan function on the model, its result listed (a generator run to its end): an error raised in
    the user's code is one line naming their function and the error, not a traceback through zeropipe."""
    from collections.abc import Iterator
    try:
        out = fn(model)
        return list(out) if isinstance(out, Iterator) else out   # anything else: _plan_rules says what it must be
    except Exception as exc:
        raise ConfigError(f"--tp-plan {ref} raised {type(exc).__name__}: {exc}; fix the function") from None


def _plan_rules(items, ref: str) -> tuple[TPRule, ...]:
    """A plan function's result as TPRules (one-line ConfigError when it is not a list of rules)."""
    try:
        rules = tuple(r if isinstance(r, TPRule) else TPRule(pattern=r[0], style=r[1], parts=r[2] if len(r) > 2 else 1)
                      for r in items)
    except (TypeError, IndexError, KeyError):
        rules = ()
    if not rules or not all(isinstance(r.pattern, str) and isinstance(r.parts, int) and r.parts >= 1 for r in rules):
        raise ConfigError(f"--tp-plan {ref} must return a non-empty list of (pattern, style) or (pattern, style, "
                          "parts) tuples with parts >= 1")
    for r in rules:
        check_fused_parts(r.parts, f"--tp-plan {ref}: '{r.pattern}' parts")
    return rules


def check_rules(model, rules: tuple[TPRule, ...], ref: str) -> None:
    """Every rule has a known style and names at least one module, of the kind its style splits."""
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    for r in rules:
        if r.style == "local_width":
            local_widths(model, r, ref)
            continue
        if r.style not in CUSTOM_STYLES:
            raise ConfigError(f"--tp-plan {ref}: unknown style {r.style!r} for {r.pattern!r}; use one of "
                              f"{', '.join(CUSTOM_STYLES)}")
        matched = [n for n in kinds if n and fnmatch.fnmatchcase(n, r.pattern)]
        if not matched:
            raise ConfigError(f"--tp-plan {ref}: {r.pattern!r} matches no module of {type(model).__name__}; patterns "
                              "are module names (model.named_modules()) with * wildcards")
        if all(style_of(n, rules) is not r for n in matched):
            raise ConfigError(f"--tp-plan {ref}: {r.pattern!r} only matches modules an earlier rule styles (the "
                              "first matching rule wins); put it before them")
        allowed = STYLE_KINDS[r.style] or ()   # none: the style takes a module of any kind
        wrong = [n for n in matched if allowed and kinds[n] not in allowed]
        if wrong:
            raise ConfigError(f"--tp-plan {ref}: {r.style} splits {' or '.join(allowed)} modules, but "
                              f"{wrong[0]} is a {kinds[wrong[0]]}")
        if r.parts > 1 and r.style != "colwise":
            raise ConfigError(f"--tp-plan {ref}: parts={r.parts} on {r.pattern!r}: only colwise rules take parts")
    _check_regions(model, rules, ref)


def local_widths(model, rule: TPRule, ref: str) -> list[int]:
    """The values of a local_width rule's attribute on every module its pattern names (`<module pattern>.<attr>`),
    or one line saying what is wrong: they must exist and be ints (the full widths the forward cuts at)."""
    pattern, _, attr = rule.pattern.rpartition(".")
    modules = [m for n, m in model.named_modules() if n and fnmatch.fnmatchcase(n, pattern)]
    if not pattern or not modules:
        raise ConfigError(f"--tp-plan {ref}: local_width {rule.pattern!r} must be '<module pattern>.<attribute>' "
                          f"naming modules of {type(model).__name__}")
    values = [getattr(m, attr, None) for m in modules]
    widths = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    if len(widths) != len(values):
        raise ConfigError(f"--tp-plan {ref}: local_width {rule.pattern!r}: the modules {pattern!r} names need an int "
                          f"attribute {attr!r} (the width their forward splits at)")
    return widths


def _check_regions(model, rules: tuple[TPRule, ...], ref: str) -> None:
    """A region holding split linears makes its input one DTensor (executor: _replicated_region): a module with
    whole parameters inside it (a norm) would mix DTensors and tensors. A head_norm's parameters become replicated
    DTensors (torch's SequenceParallel), so it may sit there, as Qwen3's q/k norms sit in attention."""
    styles = {n: r.style for n, _ in model.named_modules() if n and (r := style_of(n, rules))}
    for name, module in model.named_modules():
        if styles.get(name) != "region" or not any(s in SPLIT_STYLES for n, s in styles.items()
                                                    if n.startswith(name + ".")):
            continue
        for sub_name, sub in module.named_modules(prefix=name):
            split_above = any(styles.get(a) in (*SPLIT_STYLES, "head_norm") for a in _ancestors(sub_name, name))
            if not split_above and any(True for _ in sub.parameters(recurse=False)):
                raise ConfigError(f"--tp-plan {ref}: region {name} holds {sub_name}, whose parameters are not split; "
                                  "a region holds only its split linears (as an attention or MLP module does)")


def _ancestors(name: str, top: str) -> list[str]:
    """`name` and the modules above it, below `top`."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(top.split(".")) + 1, len(parts) + 1)]


def custom_shape(model, rules: tuple[TPRule, ...], plan: str) -> TPShape:
    """The TPShape of a model under custom rules (checked): heads from its config when it has one, the gcd of the
    split widths (output features / parts of colwise, input features of rowwise, the vocabulary) as ffn, the
    residual width (rowwise outputs) as hidden."""
    check_rules(model, rules, plan.removeprefix(CUSTOM))
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None) or 0
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    widths = [w for r in rules if r.style == "local_width" for w in local_widths(model, r, plan)]   # tp divides them
    hidden, vocab = [], []
    for name, m in model.named_modules():
        rule = style_of(name, rules) if name else None
        if rule is None or rule.style not in SPLIT_STYLES:
            continue
        out_f, in_f = _features(m)
        if rule.style in ("embedding", "head"):
            vocab.append(m.weight.shape[0] if rule.style == "embedding" else out_f)
        elif rule.style == "colwise":
            widths.append(out_f // rule.parts)
        else:
            widths.append(in_f)
            hidden.append(out_f)
    vocab_split = bool(vocab) and not _vocab_tied(model, rules)
    return TPShape(plan=plan, heads=heads, kv_heads=kv_heads, ffn=math.gcd(*widths, *(vocab if vocab_split else ())),
                   hidden=getattr(config, "hidden_size", None) or max(set(hidden), key=hidden.count, default=0),
                   vocab=max(vocab, default=0), vocab_split=vocab_split, rules=rules)


def _features(m) -> tuple[int, int]:
    """(output, input) features of nn.Linear (weight (out, in)) or transformers' Conv1D (weight (in, out))."""
    w = m.weight.shape
    return (w[1], w[0]) if type(m).__name__ == "Conv1D" else (w[0], w[1] if len(w) > 1 else 0)


def _vocab_tied(model, rules: tuple[TPRule, ...]) -> bool:
    """Whether a vocabulary-split module's weight is shared with another module (a tied head): it stays whole."""
    owners: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return any(owners.get(id(getattr(m, "weight", None)), 0) > 1 for n, m in model.named_modules()
               if (r := style_of(n, rules)) is not None and r.style in ("embedding", "head"))
