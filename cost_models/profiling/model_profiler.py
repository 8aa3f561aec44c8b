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

This module runs the steps and assembles the ModelProfile; the steps live beside it in cost_models.profiling: units
(steps 1-2), counting (step 3, with tp_watch for what tensor parallelism splits and split_backward for what a
pipeline's split backward keeps), timing (steps 4-5), flops (the FLOP counter and the meta attention substitute) and
progress (the progress report).
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
from collections import OrderedDict
from typing import Callable

import psutil
import torch
from torch import nn

from cost_models.models.losses import loss_kind, synthetic_token_targets, takes_targets
from cost_models.models.moe import check_meta_routing
from cost_models.models.pipelining import HF_DECODER, TRACED, pipeline_support, traced_edges
from cost_models.models.source import DTYPES, ModelSource, input_spec, source_input_kind
from cost_models.models.tp_shape import tp_shape
from cost_models.profiling.counting import ModuleResult, UnitResults, count_module, repeat_counts
from cost_models.profiling.flops import FusedAttentionOnMeta, attention_ops
from cost_models.profiling.moe import measure_moe
from cost_models.profiling.progress import Progress, ProgressFn
from cost_models.profiling.split_backward import SPLIT_MEMO, split_kept_in_stages
from cost_models.profiling.tensors import tensor_bytes
from cost_models.profiling.timing import mixed_factor, time_units, unit_timing
from cost_models.profiling.tp_watch import model_tp_rules, norm_style, param_split
from cost_models.profiling.units import data_flow_edges, find_units
from cost_models.records.errors import ConfigError, ProfileError
from cost_models.records.formatting import fixed, now_utc
from cost_models.records.limits import check_seq_len
from cost_models.records.profile import ModelProfile, MoEUnit, SharedParam, TPUnit, UnitEdge, UnitProfile
from cost_models.records.tensor_parallel import TPRule
from cost_models.records.work import WorkCounts
from cost_models.torch_compat.host import background_runnable, keep_freed_memory, profile_clock
from cost_models.torch_compat.optimizers import time_optimizers
from cost_models.torch_compat.torch_private import storage_id


def _measure_units(model: nn.Module, inputs: tuple[torch.Tensor, ...], model_name: str, units, *, excluded: set[int],
                   loss: str, timed: bool, warmup: int, repeats: int, rules: tuple[TPRule, ...] | None,
                   seq_len: int, on_progress: ProgressFn | None,
                   on_estimate: Callable[[float], None] | None,
                   ) -> tuple[UnitResults, int, set[str], tuple["UnitEdge", ...], float, tuple[str, ...]]:
    """Find the units (steps 1-2 of the module doc), then measure each of their modules alone: all counted
    (step 3), then, in real mode, all timed (step 4). `on_estimate(seconds)`, in real mode, gets the time the
    timed runs should take, between the two passes."""
    unit_defs, capture, model_fc = find_units(model, inputs, model_name, units)
    edges = data_flow_edges(unit_defs, capture)

    batch = inputs[0].shape[0]
    progress = Progress({m: capture.fwd_flops.get(m, 0) for _, mods in unit_defs for m in mods}, timed=timed,
                        warmup=warmup, repeats=repeats, batch=batch, on_progress=on_progress)
    last = unit_defs[-1][1][-1]
    SPLIT_MEMO.clear()
    results_by_unit: UnitResults = []
    attention: set[str] = set(attention_ops(model_fc))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    for name, mods in unit_defs:
        progress.unit(f"counting {name}")
        results = []
        for m in mods:
            t0 = time.perf_counter()
            results.append(count_module(model.get_submodule(m), capture.inputs[m], excluded=excluded, batch=batch,
                                        loss=loss if m == last else None, name=m, rules=rules, seq_len=seq_len,
                                        dtype=dtype))
            progress.counted(m, time.perf_counter() - t0)
            attention |= results[-1].attention
        results_by_unit.append((name, mods, results))
    split_kept_in_stages(model, unit_defs, capture, results_by_unit, excluded=excluded, loss=loss)
    repeat_counts(results_by_unit, capture.calls)
    in_model: float = 1.0
    notes: tuple[str, ...] = ()
    if timed:
        seconds = progress.timing_starts()
        if on_estimate:
            on_estimate(seconds)
        in_model, notes = time_units(model, inputs, results_by_unit, capture, progress, loss=loss, last=last,
                                     batch=batch, warmup=warmup, repeats=repeats)
    progress.done()
    return results_by_unit, model_fc.get_total_flops(), attention, edges, in_model, notes


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
    param_bytes = sum(tensor_bytes(p) for p in meta_model.parameters())
    # parameters + gradients + a working margin of the same size: a floor, not an estimate of the activations.
    need = 3 * param_bytes
    avail = torch.cuda.mem_get_info()[0] if device == "cuda" else psutil.virtual_memory().available
    where = "the GPU" if device == "cuda" else "this machine"
    if need > avail:
        raise ProfileError(f"real-mode profiling of {source.name} needs about {fixed(need, 'GiB', 1)}, {where} has "
                           f"{fixed(avail, 'GiB', 1)} available; add --meta to profile it without weights")


def profile_model(source: ModelSource, *, micro_batch_size: int, seq_len: int, dtype: str = "fp32",
                  meta: bool = False, device: str = "auto", units: str | list[str] | None = None, warmup: int = 2,
                  repeats: int = 5, threads: int | None = None, command: str = "",
                  on_progress: ProgressFn | None = None,
                  on_estimate: Callable[[float], None] | None = None, settle_s: float = 0.0) -> ModelProfile:
    """Measure `source` at one micro-batch of (micro_batch_size, seq_len) and return its ModelProfile.

    `dtype` auto: fp32 on CPU (CPU ranks run every plan in fp32), bf16 on a GPU and in meta mode.
    `device` (real mode): auto (the GPU when torch sees one, else the CPU), cpu or cuda; a GPU profile records
    its device's name, and the planner uses its times for clusters of that GPU only (compute.uses_measured_times).
    `threads` sets torch's thread count while measuring (and restores it): real-mode times are only comparable
    with a run whose ranks use as many (executor CPU ranks use one). `on_progress(done, total, what)` reports the
    share of the expected time done (see progress.Progress: a constant total, done == total at the end);
    `on_estimate(seconds)`, in real mode, how long the timed runs will take, once the counting pass has measured
    one forward and backward of every unit (about 1 / (1 + 1.5 x (warmup + repeats)) of the work). `settle_s`
    (real mode on CPU): how long to wait for other programs' runnable tasks to leave a core free before timing
    (settle); the profile's timing notes say what was found and done."""
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    check_seq_len(seq_len)   # before a micro-batch of it is allocated
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _profile(source, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype, meta=meta,
                        device=device, units=units, warmup=warmup, repeats=repeats, command=command,
                        on_progress=on_progress, on_estimate=on_estimate, settle_s=settle_s)
    except torch.cuda.OutOfMemoryError:
        raise ProfileError(f"the GPU ran out of memory profiling {source.name} at micro-batch {micro_batch_size} x "
                           f"{seq_len}; use a smaller --micro-batch-size or --seq-len, --device cpu, or --meta to "
                           f"count without running") from None
    finally:
        torch.set_num_threads(previous)


def _pipelining(model: nn.Module, units, inputs, edges: tuple[UnitEdge, ...]) -> tuple[str, tuple[UnitEdge, ...]]:
    """Whether the executor can cut stages that compute what this forward computes (planner: else pp = 1 only), and
    the data flow its stages send: for traced stages, every value that crosses a cut, work between the
    units included (pipelining.traced_edges); for a transformers decoder, the hidden states its adapter hands on at
    every cut (executor.hf_stages), the first layer's input; a chain's units hand on their outputs (the captured
    `edges`)."""
    pipelining = pipeline_support(model, units)
    if pipelining == TRACED:
        try:
            with torch.no_grad():
                flow = traced_edges(model, units, inputs)
            return pipelining, tuple(UnitEdge(src=a, dst=b, bytes=n) for a, b, n in flow)
        except Exception:   # the user's forward, run once more: should it fail now, keep what the capture saw
            return pipelining, edges
    hidden = next((e.bytes for e in edges if e.src == 1 and e.dst == 2), None)
    if pipelining == HF_DECODER and hidden is not None:
        return pipelining, tuple(UnitEdge(src=i, dst=i + 1, bytes=hidden) for i in range(len(units) - 1))
    return pipelining, edges


def _as_trained(model: nn.Module, inputs: tuple[torch.Tensor, ...], vocab: int | None) -> tuple[torch.Tensor, ...]:
    """The forward's arguments as training calls it: a model that computes its own loss also takes its targets
    (losses.takes_targets), so its training branch is what is measured, not an inference branch."""
    return (*inputs, synthetic_token_targets(inputs[0], vocab)) if takes_targets(model) else inputs


def _profile(source: ModelSource, *, micro_batch_size: int, seq_len: int, dtype: str, meta: bool, device: str, units,
             warmup: int, repeats: int, command: str, on_progress: ProgressFn | None,
             on_estimate: Callable[[float], None] | None, settle_s: float = 0.0) -> ModelProfile:
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
    model = source.build(device=device, dtype=torch_dtype).train()
    check_meta_routing(model)   # transformers' MoE experts route by data: not countable on meta
    inputs = source.example_input(model, micro_batch_size, seq_len, device)
    in_kind, vocab = source_input_kind(source, model, inputs, seq_len)
    loss, inputs = loss_kind(in_kind), _as_trained(model, inputs, vocab if in_kind == "tokens" else None)
    excluded = {storage_id(t) for t in list(model.parameters()) + list(model.buffers())}

    with contextlib.ExitStack() as stack:
        stack.enter_context(source.forward_context())
        if meta:
            stack.enter_context(FusedAttentionOnMeta())
        rules, load_before = model_tp_rules(model), os.getloadavg()[0]
        beside_before, settled = (0.0, None) if meta else settle(settle_s if device == "cpu" else 0.0)
        unit_results, model_fwd_flops, attention, edges, in_model, notes = _measure_units(
            model, inputs, source.name, units, excluded=excluded, loss=loss, timed=not meta, warmup=warmup,
            repeats=repeats, rules=rules, seq_len=seq_len, on_progress=on_progress, on_estimate=on_estimate)
        moe = measure_moe(model, inputs, [(name, mods) for name, mods, _ in unit_results], excluded=excluded)
        mixed = 1.0
        if device == "cuda" and dtype == "bf16":
            mixed = mixed_factor(source, model, inputs, unit_results[-1][2][-1].target, loss=loss, warmup=warmup,
                                 repeats=repeats)
    # the optimizer's step, timed on this device (compute.optimizer_step_time prices a rank's update from it)
    optimizers = () if meta else time_optimizers(model, torch.device(device), warmup=warmup, repeats=repeats)
    unit_profiles, shared = _account_params(model, unit_results, rules, moe)
    pipelining, edges = _pipelining(model, [(name, mods) for name, mods, _ in unit_results], inputs, edges)
    total_params = sum(p.numel() for p in model.parameters())
    assigned = sum(u.params for u in unit_profiles)
    largest = max(unit_profiles, key=lambda u: (u.params, u.fwd_flops))
    return ModelProfile(
        name=source.name, source=source.ref, mode="meta" if meta else "real", dtype=dtype,
        micro_batch_size=micro_batch_size, seq_len=seq_len,
        input=input_spec(inputs, kind=in_kind, vocab_size=vocab), loss=loss, units=tuple(unit_profiles),
        total_params=total_params, total_param_bytes=sum(tensor_bytes(p) for p in model.parameters()),
        unassigned_params=total_params - assigned, shared=tuple(shared),
        model_fwd_flops=model_fwd_flops, attention_kernels=tuple(sorted(attention)), edges=edges, pipelining=pipelining,
        tensor_parallel=tp_shape(model), in_model_factor=in_model, mixed_factor=mixed, optimizer_timings=optimizers,
        largest_unit=largest.name, device="gpu" if device == "cuda" else device,
        device_name=torch.cuda.get_device_name() if device == "cuda" else "", threads=torch.get_num_threads(),
        torch_version=torch.__version__, command=command, created_at=now_utc(),
        **_load_record(load_before, beside_before, meta), timing_notes=(settled, *notes) if settled else notes)


# Readings of the runnable count around the timed runs (host.background_runnable takes their median, 20 ms apart):
# fewer than the probe's, as every real profile pays them; a median of 7 still leaves out a task that ran for one
# reading.
PROFILE_RUNNABLE_SAMPLES = 7


LOADAVG = "/proc/loadavg"   # proc(5): its fourth field counts the runnable tasks (host.background_runnable)

# How long `planner profile` and `planner demo` wait for a busy machine to leave a core free before timing: long
# enough for a job that just ended to exit (the cluster probe counts other programs' tasks before and after its
# ranks for the same reason), short beside a profile's own minute or more.
SETTLE_S = 5.0


def settle(bound_s: float, poll_s: float = 0.5, threads: int | None = None) -> tuple[float, str | None]:
    """Wait up to `bound_s` until other programs' runnable tasks (host.background_runnable) leave this process's
    `threads` CPUs (default: torch's thread count) of os.cpu_count(). Returns the count it ended at, and, where it
    was asked to wait and the machine was busy, a timing note: how long it waited and whether the load passed.
    Thread CPU time leaves the waits for a core out of the unit times (host.work_clock), but the machine's speed
    under load drifts (benchmarks/results/measurements.md, "Profiles under load"). Off Linux (no /proc/loadavg):
    (0.0, None)."""
    if not os.path.exists(LOADAVG):
        return 0.0, None
    cpus, t0, threads = os.cpu_count() or 1, time.monotonic(), threads or torch.get_num_threads()
    first = n = background_runnable(PROFILE_RUNNABLE_SAMPLES)
    if n + threads <= cpus or bound_s <= 0:
        return n, None
    while time.monotonic() - t0 < bound_s and n + threads > cpus:
        time.sleep(poll_s)
        n = background_runnable(PROFILE_RUNNABLE_SAMPLES)
    waited = time.monotonic() - t0
    if n + threads <= cpus:
        return n, (f"{first:g} other programs' runnable task(s) on {cpus} CPUs before timing: waited {waited:.1f} s "
                   f"until {n:g} were left")
    return n, (f"{first:g} other programs' runnable task(s) on {cpus} CPUs before timing, {n:g} still after "
               f"waiting {waited:.1f} s: timed beside them")


def _load_record(load_before: float, beside_before: float, meta: bool) -> dict:
    """ModelProfile.load_1min, runnable_beside, cpus and clock: the load and other programs' runnable tasks before
    and after the timed runs, and the clock that timed them (timing._time_module's; none in meta mode)."""
    if meta:
        return {"load_1min": (), "cpus": 0}
    return {"load_1min": (round(load_before, 2), round(os.getloadavg()[0], 2)),
            "runnable_beside": ((beside_before, background_runnable(PROFILE_RUNNABLE_SAMPLES))
                                if os.path.exists(LOADAVG) else ()),
            "cpus": os.cpu_count() or 0, "clock": profile_clock()[1]}


def _tp_unit(numels: list[int], splits: list[int], norms: list[str], results: list[ModuleResult]) -> TPUnit:
    """`norms`: per parameter tensor, the norm style of its module ("norm", "head_norm") or ""."""
    counts = {k: sum(r.tp.get(k, 0) for r in results) for k in results[0].tp} if results[0].tp else {}
    return TPUnit(param_split=tuple(splits), split_params=sum(n for n, f in zip(numels, splits) if f == 1),
                  vocab_params=sum(n for n, f in zip(numels, splits) if f == 2),
                  norm_params=sum(n for n, f in zip(numels, norms) if f == "norm"), norm_tensors=norms.count("norm"),
                  head_norm_params=sum(n for n, f in zip(numels, norms) if f == "head_norm"),
                  head_norm_tensors=norms.count("head_norm"), **counts)


def _account_params(model: nn.Module, unit_results, rules: tuple[TPRule, ...] | None = None,
                    moe: dict[str, MoEUnit] | None = None) -> tuple[list[UnitProfile], list[SharedParam]]:
    """Count each parameter once, in the first unit (in call order) that uses it; record tied ones as shared (and,
    with TP rules, how each counted tensor splits; with `moe`, the units' mixture-of-experts blocks)."""
    owner: dict[int, tuple[str, str]] = {}            # id(param) -> (canonical name, owning unit)
    aliases: "OrderedDict[int, list[tuple[str, str]]]" = OrderedDict()
    profiles = []
    for name, mods, results in unit_results:
        params = pbytes = tensors = 0
        numels: list[int] = []
        splits: list[int] = []
        norms: list[str] = []
        shared_here: list[str] = []
        for m in mods:
            for pname, p in model.get_submodule(m).named_parameters(prefix=m, remove_duplicate=False):
                if id(p) not in owner:
                    owner[id(p)] = (pname, name)
                    params += p.numel()
                    pbytes += tensor_bytes(p)
                    tensors += 1
                    numels.append(p.numel())
                    splits.append(param_split(pname, rules) if rules is not None else 0)
                    norms.append(norm_style(pname, rules) if rules is not None else "")
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
            fwd_time=unit_timing([r.fwd_times for r in results]) if timed else None,
            bwd_time=unit_timing([r.bwd_times for r in results]) if timed else None,
            fwd_time_one=(unit_timing([r.fwd_times_one for r in results])
                          if timed and results[0].fwd_times_one else None),
            bwd_time_one=(unit_timing([r.bwd_times_one for r in results])
                          if timed and results[0].bwd_times_one else None),
            tp=_tp_unit(numels, splits, norms, results) if rules is not None else None,
            fwd_work=functools.reduce(WorkCounts.plus, (r.fwd_work for r in results)),
            bwd_work=functools.reduce(WorkCounts.plus, (r.bwd_work for r in results)),
            moe=(moe or {}).get(name),
        ))
    numel = {id(p): p.numel() for p in model.parameters()}
    shared = [SharedParam(name=owner[pid][0], aliases=tuple(a for a, _ in al),
                          units=tuple(dict.fromkeys([owner[pid][1]] + [u for _, u in al])), numel=numel[pid])
              for pid, al in aliases.items()]
    return profiles, shared
