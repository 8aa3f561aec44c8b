"""Timing, in real mode (steps 4 and 5 of model_profiler's module doc): each module's forward and backward on its
captured input, after warm-up, at the micro-batch and on one sample; the whole model end to end over its units' sum
(ModelProfile.in_model_factor) and under autocast over plain bf16 (ModelProfile.mixed_factor); and a unit's Timing
from its modules' runs."""
from __future__ import annotations

import contextlib
import functools
import statistics
from typing import Callable

import torch
from torch import nn

from cost_models.models.source import ModelSource
from cost_models.profiling.counting import ModuleResult, UnitResults, repeated
from cost_models.profiling.progress import Progress
from cost_models.profiling.tensors import backward_roots, fresh, one_sample
from cost_models.profiling.units import Capture
from cost_models.records.profile import Timing
from cost_models.torch_compat.host import profile_clock


def _sync() -> None:
    """Wait for queued GPU kernels, so a host clock times them (CUDA launches are asynchronous); nothing on CPU."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _time_module(module: nn.Module, captured, loss: str | None, target, warmup: int,
                 repeats: int, tick: Callable[[], None]) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of each repeat after `warmup` untimed runs, by host.profile_clock (on CPU, this
    thread's CPU time: under load the whole model's repeats, several scheduler slices long, waited for a core
    where a block's rarely did, which moved in_model_factor: benchmarks/results/measurements.md, "Profiles under
    load"); `tick()` after every run."""
    fwd, bwd = [], []
    clock = profile_clock()[0]
    for i in range(warmup + repeats):
        args, kwargs = fresh(captured)
        _sync()
        t0 = clock()
        roots = backward_roots(module(*args, **kwargs), loss, target)
        _sync()
        t1 = clock()
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
        _sync()
        t2 = clock()
        module.zero_grad(set_to_none=True)
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        tick()
    return fwd, bwd


def _time_into(res: ModuleResult, module: nn.Module, captured, *, loss: str | None, warmup: int, repeats: int,
               batch: int, tick: Callable[[float], None]) -> None:
    """Forward and backward times at the profile's micro-batch and, when that is larger, at one sample, so time
    can be modelled as a + b * batch (fixed per-call overhead plus per-sample work) rather than proportional to the
    batch. `tick(share)` after every run: 1 for a run at the micro-batch, 1 / batch for one on one sample."""
    res.fwd_times, res.bwd_times = _time_module(module, captured, loss, res.target, warmup, repeats, lambda: tick(1.0))
    if batch > 1:
        target = res.target[:1] if res.target is not None else None
        res.fwd_times_one, res.bwd_times_one = _time_module(module, one_sample(captured, batch), loss, target, warmup,
                                                            repeats, lambda: tick(1 / batch))


def unit_timing(per_module: list[list[float]]) -> Timing:
    """Unit time = sum over its modules; median, min and max are taken per module and summed."""
    return Timing(median_s=sum(statistics.median(t) for t in per_module), min_s=sum(min(t) for t in per_module),
                  max_s=sum(max(t) for t in per_module), repeats=len(per_module[0]))


def time_units(model: nn.Module, inputs: tuple[torch.Tensor, ...], results_by_unit: UnitResults, capture: Capture,
               progress: Progress, *, loss: str, last: str, batch: int, warmup: int,
               repeats: int) -> tuple[float, tuple[str, ...]]:
    """Step 4 of model_profiler's module doc into each module's result, identical units pooled where they disagree
    (pool_identical), then step 5: the whole model's in_model_factor. Returns it and what pooling did."""
    for name, mods, results in results_by_unit:
        progress.unit(f"timing {name}")
        for m, res in zip(mods, results):
            _time_into(res, model.get_submodule(m), capture.inputs[m], loss=loss if m == last else None,
                       warmup=warmup, repeats=repeats, batch=batch, tick=functools.partial(progress.tick, m))
    notes = pool_identical(model, results_by_unit, capture, last=last, batch=batch, repeats=repeats)
    _repeat_times(results_by_unit, capture.calls)
    progress.unit("timing the whole model")
    return _in_model_factor(model, inputs, results_by_unit, capture, loss=loss, last=last, repeats=repeats), notes


def _repeat_times(results_by_unit: UnitResults, calls: dict[str, int]) -> None:
    """A module the forward runs k times takes k times its measured time per step (counting.repeat_counts)."""
    for res, k in repeated(results_by_unit, calls):
        for samples in (res.fwd_times, res.bwd_times, res.fwd_times_one, res.bwd_times_one):
            samples[:] = [k * t for t in samples]


# Identical units (the same modules, parameters and input shapes: a model's repeated blocks) do the same work, so
# their times may differ by the machine's noise only, about +-15% run to run on a shared machine. Medians further
# apart than this ratio were timed under different load (benchmarks/results/measurements.md, "Identical units timed
# apart"): they are timed again, interleaved, and pooled.
POOL_SPREAD = 1.3


def _signature(model: nn.Module, mods: tuple[str, ...], capture: Capture) -> tuple:
    """What makes two units the same work: each module's tree (names below it and classes), its parameters' shapes
    and dtypes, and its captured input's tensor shapes and dtypes."""
    from cost_models.torch_compat.torch_private import tree_leaves
    out = []
    for m in mods:
        mod = model.get_submodule(m)
        tree = tuple((n, type(sub).__qualname__) for n, sub in mod.named_modules())
        params = tuple((n, tuple(p.shape), p.dtype) for n, p in mod.named_parameters())
        shapes = tuple((tuple(t.shape), t.dtype) for t in tree_leaves(capture.inputs[m]) if isinstance(t, torch.Tensor))
        out.append((tree, params, shapes))
    return tuple(out)


def _unit_seconds(results: list[ModuleResult]) -> float:
    return sum(statistics.median(r.fwd_times) + statistics.median(r.bwd_times) for r in results)


def pool_identical(model: nn.Module, results_by_unit: UnitResults, capture: Capture, *, last: str, batch: int,
                   repeats: int) -> tuple[str, ...]:
    """Identical units whose medians are more than POOL_SPREAD apart are timed again round-robin (one run of each in
    turn, `repeats` rounds, after one untimed round), so load that comes and goes falls on all of them alike; every
    one of them then gets all those runs (their pooled samples). Returns one line per group pooled."""
    groups: dict[tuple, list[int]] = {}
    for i, (_, mods, results) in enumerate(results_by_unit):
        if last not in mods and results[0].fwd_times:
            groups.setdefault(_signature(model, mods, capture), []).append(i)
    notes = []
    for idx in (g for g in groups.values() if len(g) > 1):
        before = [_unit_seconds(results_by_unit[i][2]) for i in idx]
        if max(before) <= POOL_SPREAD * min(before):
            continue
        pooled = _interleaved(model, [results_by_unit[i] for i in idx], capture, batch=batch, repeats=repeats)
        for i in idx:
            for res, samples in zip(results_by_unit[i][2], pooled):
                res.fwd_times, res.bwd_times, res.fwd_times_one, res.bwd_times_one = (list(x) for x in samples)
        names = [results_by_unit[i][0] for i in idx]
        notes.append(f"{len(idx)} identical units ({names[0]} .. {names[-1]}) timed {1e3 * min(before):.3g} to "
                     f"{1e3 * max(before):.3g} ms each (forward + backward), more than x{POOL_SPREAD:g} apart: the "
                     f"machine's load changed while they ran; timed again interleaved and pooled: "
                     f"{1e3 * _unit_seconds(results_by_unit[idx[0]][2]):.3g} ms each")
    return tuple(notes)


def _interleaved(model: nn.Module, units: list, capture: Capture, *, batch: int,
                 repeats: int) -> list[tuple[list[float], list[float], list[float], list[float]]]:
    """Per module position of the (identical) units: forward and backward seconds at the micro-batch and, when it
    is larger than one, on one sample, from every unit's runs, taken one run of each unit in turn."""
    pooled: list[tuple[list[float], list[float], list[float], list[float]]] = [
        ([], [], [], []) for _ in units[0][1]]
    for round_ in range(repeats + 1):    # round 0: untimed, as a warm-up
        for _, mods, results in units:
            for j, m in enumerate(mods):
                module, captured = model.get_submodule(m), capture.inputs[m]
                f, b = _time_module(module, captured, None, results[j].target, 0, 1, lambda: None)
                f1, b1 = (_time_module(module, one_sample(captured, batch), None, None, 0, 1, lambda: None)
                          if batch > 1 else ([], []))
                if round_:
                    for acc, new in zip(pooled[j], (f, b, f1, b1)):
                        acc.extend(new)
    return pooled


def _in_model_factor(model: nn.Module, inputs: tuple[torch.Tensor, ...], results_by_unit: UnitResults,
                     capture: Capture, *, loss: str, last: str, repeats: int) -> float:
    """The whole model's forward, loss and backward, timed end to end, over the sum of its modules' times
    (ModelProfile.in_model_factor): the median over `repeats` rounds of one run of the whole model then one of each
    module, each after an untimed run of itself (the warm cache of a unit timed again and again, as its medians
    were), so both sides of each ratio meet the machine in the same state: a ratio of the whole model timed after
    every unit took in the machine's drift between them (measured: benchmarks/results/measurements.md, "Profiles
    under load"). A module the forward runs k times counts k times (_repeat_times). 1.0 where the model's output
    is neither a tensor nor has .logits (no loss to take here)."""
    target = results_by_unit[-1][2][-1].target
    whole = _whole_model(model, inputs, target)
    if whole is None:
        return 1.0
    ratios = []
    for _ in range(repeats):
        f, b = _time_module(whole, (_as_received(inputs), {}), loss, target, 1, 1, lambda: None)
        units = 0.0
        for _, mods, results in results_by_unit:
            for m, res in zip(mods, results):
                uf, ub = _time_module(model.get_submodule(m), capture.inputs[m], loss if m == last else None,
                                      res.target, 1, 1, lambda: None)
                units += capture.calls.get(m, 1) * (uf[0] + ub[0])
        if units > 0 and f[0] + b[0] > 0:
            ratios.append((f[0] + b[0]) / units)
    return statistics.median(ratios) if ratios else 1.0


def _as_received(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The model's inputs as the capture marks them (units.Capture._leaf): float ones requiring grad."""
    return tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)


def _whole_model(model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor | None,
                 autocast: torch.dtype | None = None) -> nn.Module | None:
    """The whole model as a module whose output a loss can be taken on: its tensor output, or an output object's
    .logits (transformers' causal LMs), its forward under torch.autocast in `autocast` if given; None where there is
    no target or neither (checked once, without grad)."""

    class _Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model   # a submodule, so _time_module's zero_grad clears its gradients between runs

        def forward(self, *args):
            cast = torch.autocast(args[0].device.type, dtype=autocast) if autocast else contextlib.nullcontext()
            with cast:
                out = self.inner(*args)
            return out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if target is None:
        return None
    with torch.no_grad():
        if not isinstance(_Logits()(*inputs), torch.Tensor):
            return None
    return _Logits()


def _whole_model_seconds(model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor | None, *,
                         loss: str, warmup: int, repeats: int, autocast: torch.dtype | None = None) -> float | None:
    """Median seconds of the whole model's forward, loss and backward (_whole_model); None where it has no loss."""
    whole = _whole_model(model, inputs, target, autocast)
    if whole is None:
        return None
    fwd, bwd = _time_module(whole, (_as_received(inputs), {}), loss, target, warmup, repeats, lambda: None)
    model.zero_grad(set_to_none=True)
    return statistics.median([f + b for f, b in zip(fwd, bwd)])


def mixed_factor(source: ModelSource, model: nn.Module, inputs: tuple[torch.Tensor, ...], target, *, loss: str,
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
