"""What torch's split backward keeps alive: torch.distributed.pipelining runs a stage's backward in two parts, the
input gradient and then the weight gradient from the intermediates the first kept, so the saved tensors of nodes on
no weight's path stay until the graph goes. Measured for one module alone (kept_after_split, memoised across a
model's repeated blocks) and for the chains of units a pipeline stage may start with (split_kept_in_stages)."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from cost_models.profiling.tensors import backward_roots, fresh
from cost_models.profiling.units import Capture, feeds
from cost_models.torch_compat.torch_private import pipelining_split_backward, storage_id, tree_leaves, view_base


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


def split_kept_in_stages(model: nn.Module, unit_defs, capture: Capture, results_by_unit, *, excluded: set[int],
                         loss: str | None) -> None:
    """Set what torch's split backward keeps per micro-batch of a stage that starts at each unit (kept_after_split
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
        flat += [(model.get_submodule(m), fresh(((), capture.inputs[m][1]))[1]) for m in mods]
    names = [m for _, mods, _ in results_by_unit for m in mods]
    fed = [j > 0 and feeds(capture, names[j - 1], names[j]) for j in range(len(flat))]

    def chain(a: int, b: int) -> _Chain | None:   # units a..b as one module, if they chain
        lo, hi = spans[a][0], spans[b][1]
        return _Chain([m for m, _ in flat[lo:hi]], [k for _, k in flat[lo:hi]]) if all(fed[lo + 1:hi]) else None

    def kept(a: int, b: int, with_loss: bool) -> int | None:
        run = chain(a, b)
        target = results_by_unit[-1][2][-1].target if with_loss else None
        return None if run is None else kept_after_split(run, run, capture.inputs[names[spans[a][0]]], excluded,
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


# kept_after_split by _split_signature, per profile run (model_profiler._measure_units clears it)
SPLIT_MEMO: dict[tuple, int] = {}


def _split_signature(module: nn.Module, captured, loss: str | None) -> tuple:
    """What kept_after_split depends on: the modules' classes and parameter shapes, the input shapes and the loss
    (a model's repeated blocks share one measurement: 80 layers are measured once, not 80 times)."""
    parts = list(module.parts) if isinstance(module, _Chain) else [module]
    shapes = tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tree_leaves(captured)
                   if isinstance(t, torch.Tensor))
    return (tuple((type(m).__qualname__, tuple((n, tuple(p.shape)) for n, p in m.named_parameters())) for m in parts),
            shapes, loss)


def kept_after_split(run: Callable, module: nn.Module, captured, excluded: set[int], loss: str | None, target) -> int:
    key = _split_signature(module, captured, loss)
    if key not in SPLIT_MEMO:
        SPLIT_MEMO[key] = _measure_kept_after_split(run, module, captured, excluded, loss, target)
    return SPLIT_MEMO[key]


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

    args, kwargs = fresh(captured)
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    params = [p for p in module.parameters() if p.requires_grad]
    if not inputs or not params:
        return 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.tensor if isinstance(h, Held) else h):
        out = run(*args, **kwargs)
        # torch detaches the stage's outputs in place after I: a view (an output that reshapes) gets a copy
        roots = [r if view_base(r) is None else r.clone() for r in backward_roots(out, loss, target)]
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
