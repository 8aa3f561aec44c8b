"""What a profile or cluster must satisfy before any cost model reads it: every number finite, non-negative, and
within MAX_NUMBER; rates, sizes and counts positive where zero would divide or mean nothing; the parts consistent.

Each check fails with one line, `FILE: json.path is VALUE; need RULE; FIX`, naming the field as it is spelled in
the file. Only what the profilers themselves guarantee is required (checked on gpt-tiny, llama-tiny, mlp-deep,
hf:gpt2, hf:llama, custom module:factory models incl. one with a root parameter, in meta and real mode), so a
file they wrote always loads.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, NoReturn

from cost_models.records.base import Record
from cost_models.records.cluster import ClusterProfile
from cost_models.records.errors import FileFormatError
from cost_models.records.limits import MAX_FUSED_PARTS, MAX_GPUS, MAX_SEQ_LEN
from cost_models.records.precision import DTYPE_BYTES
from cost_models.records.profile import OPTIMIZERS, PIPELINE_KINDS, ModelProfile, Timing, UnitProfile
from cost_models.records.tensor_parallel import CUSTOM, PLANS

PROFILE_FIX = "re-run planner profile"
CLUSTER_FIX = "correct the cluster file or re-run planner profile-cluster"

# Far above any real quantity (a 10T-parameter model's forward on a million tokens is 2e19 FLOPs; 1e30 B/s or
# FLOP/s is nowhere near hardware), yet far enough below the float limit (1.8e308) that products and sums of a few
# such numbers in the cost models stay finite: nothing non-finite can reach a plan or a written file.
MAX_NUMBER = 1e30

# The smallest rate (B/s, FLOP/s) and matmul efficiency accepted. Any device or link moves over 1e6 of either, and
# a millionth of peak is no measured efficiency (a CPU rank's probe reads far more, at efficiency 1.0:
# benchmarks/results/measurements.md, "Compute probe rates"); the floors keep quotients such as bytes / bandwidth
# or FLOPs / (peak x efficiency) below
# MAX_NUMBER / 1e-6 = 1e36 s, which sums over stages and micro-batches cannot overflow (without them a bandwidth
# of 1e-300 put 1e306 s step times in a plan).
MIN_RATE = 1.0
MIN_EFFICIENCY = 1e-6

# Fields that may be negative. R^2 of a collective fit is below 0 when the fit is worse than the mean
# (cost_models/records/fit.py computes it on unweighted times, so a noisy probe can write that). alpha and beta are not
# here: fit.py keeps both non-negative.
SIGNED = frozenset({"r2"})


def _fail(where: str, path: str, value: Any, need: str, fix: str) -> NoReturn:
    shown = "null" if value is None else repr(value)  # as the file spells it
    if isinstance(value, int) and len(shown) > 24:  # JSON allows 4300-digit integers; keep the line short
        shown = f"{shown[:6]}... ({len(shown.lstrip('-'))} digits)"
    raise FileFormatError(f"{where}: {path} is {shown}; need {need}; {fix}")


def _numbers(value: Any, path: str, field: str) -> Iterator[tuple[str, str, int | float]]:
    """(JSON path, record field, number) for every int/float in a record tree; `field` is the nearest record field
    (a list item or dict value answers to the field that holds it)."""
    if isinstance(value, Record):
        for f in dataclasses.fields(value):  # type: ignore[arg-type]
            yield from _numbers(getattr(value, f.name), f"{path}.{f.name}", f.name)
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{path}[{i}]", field)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{path}.{key}", field)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, field, value


def _check_finite(root: Record, path: str, where: str, fix: str) -> None:
    for p, field, v in _numbers(root, path, ""):
        if isinstance(v, float) and not math.isfinite(v):
            _fail(where, p, v, "a finite number", fix)
        if abs(v) > MAX_NUMBER:
            _fail(where, p, v, f"{field} <= {MAX_NUMBER:g}", fix)


def _check_non_negative(root: Record, path: str, where: str, fix: str) -> None:
    """After the specific checks, so that a field with a stricter rule (> 0, >= 1) is reported by that rule."""
    for p, field, v in _numbers(root, path, ""):
        if v < 0 and field not in SIGNED:
            _fail(where, p, v, f"{field} >= 0", fix)


def _check_rate(value: float, path: str, name: str, where: str, fix: str) -> None:
    if value <= 0:
        _fail(where, path, value, f"{name} > 0", fix)
    if value < MIN_RATE:
        _fail(where, path, value, f"{name} >= {MIN_RATE:g} per second", fix)


def validate_cluster(c: ClusterProfile, where: str, *, path: str = "cluster", fix: str = CLUSTER_FIX) -> None:
    """Refuse a cluster the cost models cannot use. `where` names the file, `path` the cluster's place in it
    (a plan's or profile's `cluster`), `fix` what the user should do."""
    _check_finite(c, path, where, fix)
    for name in ("nodes", "devices_per_node"):
        if getattr(c, name) < 1:
            _fail(where, f"{path}.{name}", getattr(c, name), f"{name} >= 1", fix)
    if c.world_size > MAX_GPUS:  # the cap --nodes meets in ClusterProfile.with_nodes, for a file that states it
        _fail(where, f"{path}.nodes", c.nodes, f"nodes x devices_per_node ({c.devices_per_node}) <= {MAX_GPUS:,}", fix)
    d = c.device
    if d.memory_bytes <= 0:
        _fail(where, f"{path}.device.memory_bytes", d.memory_bytes, "memory_bytes > 0", fix)
    if not d.peak_flops:
        _fail(where, f"{path}.device.peak_flops", d.peak_flops, "a dense FLOP/s rate per dtype, e.g. {bf16: 3.12e14}",
              fix)
    for dtype, rate in d.peak_flops.items():
        _check_rate(rate, f"{path}.device.peak_flops.{dtype}", "peak_flops", where, fix)
    if not MIN_EFFICIENCY <= d.matmul_efficiency <= 1:
        _fail(where, f"{path}.device.matmul_efficiency", d.matmul_efficiency,
              f"matmul_efficiency in [{MIN_EFFICIENCY:g}, 1] (achieved / peak)", fix)
    if d.memory_bandwidth_Bps > 0:  # 0: not known (optimizer_step_time leaves the step out); < 0: caught below
        _check_rate(d.memory_bandwidth_Bps, f"{path}.device.memory_bandwidth_Bps", "memory_bandwidth_Bps", where, fix)
    for name in ("intra_node", "inter_node"):
        link = getattr(c, name)
        if link is not None:
            _check_rate(link.bandwidth_Bps, f"{path}.{name}.bandwidth_Bps", "bandwidth_Bps", where, fix)
    if c.nodes > 1 and c.inter_node is None:
        _fail(where, f"{path}.inter_node", None, f"an inter_node link for a cluster of {c.nodes} nodes", fix)
    for i, f in enumerate(c.fits):
        if f.group_size < 1:
            _fail(where, f"{path}.fits[{i}].group_size", f.group_size, "group_size >= 1", fix)
    if c.compute is not None:  # sharing.contention and unit_times divide by these
        for name in ("ranks", "threads_per_rank"):
            if getattr(c.compute, name) < 1:
                _fail(where, f"{path}.compute.{name}", getattr(c.compute, name), f"{name} >= 1", fix)
        for name in ("flops_per_rank", "flops_alone"):
            _check_rate(getattr(c.compute, name), f"{path}.compute.{name}", name, where, fix)
    _check_non_negative(c, path, where, fix)


def _check_timing(t: Timing | None, path: str, where: str, fix: str) -> None:
    if t is not None and not t.min_s <= t.median_s <= t.max_s:
        _fail(where, f"{path}.median_s", t.median_s, f"min_s ({t.min_s!r}) <= median_s <= max_s ({t.max_s!r})", fix)


def _check_caps(p: ModelProfile, path: str, where: str, fix: str) -> None:
    """The sizes a run allocates by (records.limits): the sequence length, a TP rule's fused parts."""
    if p.seq_len > MAX_SEQ_LEN:
        _fail(where, f"{path}.seq_len", p.seq_len, f"seq_len <= {MAX_SEQ_LEN:,}", fix)
    shape = p.tensor_parallel
    for i, rule in enumerate(shape.rules if shape else ()):
        if not 1 <= rule.parts <= MAX_FUSED_PARTS:
            _fail(where, f"{path}.tensor_parallel.rules[{i}].parts", rule.parts, f"1 <= parts <= {MAX_FUSED_PARTS:,}",
                  fix)


def validate_model(p: ModelProfile, where: str, *, path: str = "model", fix: str = PROFILE_FIX) -> None:
    """Refuse a model profile the planner cannot use or would be misled by."""
    _check_finite(p, path, where, fix)
    for name in ("micro_batch_size", "seq_len"):
        if getattr(p, name) < 1:
            _fail(where, f"{path}.{name}", getattr(p, name), f"{name} >= 1", fix)
    _check_caps(p, path, where, fix)
    _check_non_negative(p, path, where, fix)  # before the sums below, which a negative part would confuse
    if p.dtype not in DTYPE_BYTES:   # activation and parameter bytes are priced by its element size
        _fail(where, f"{path}.dtype", p.dtype, f"one of {', '.join(DTYPE_BYTES)}", fix)
    if not p.units:
        _fail(where, f"{path}.units", [], "at least one unit", fix)
    for name in ("in_model_factor", "mixed_factor"):   # a whole model timed 10x its reference is a broken measurement
        if not 0 < getattr(p, name) <= 10:
            _fail(where, f"{path}.{name}", getattr(p, name), "a ratio in (0, 10]", fix)
    names: dict[str, int] = {}
    for i, u in enumerate(p.units):
        at = f"{path}.units[{i}]"
        if u.name in names:
            _fail(where, f"{at}.name", u.name, f"unit names unique (units[{names[u.name]}] has it too)", fix)
        names[u.name] = i
        # model_profiler._account_params appends one numel per tensor it counts; older files leave both empty
        if u.param_numels and (sum(u.param_numels) != u.params or len(u.param_numels) != u.param_tensors):
            _fail(where, f"{at}.params", u.params, f"params = sum of param_numels ({sum(u.param_numels)}) and "
                  f"param_tensors = their count ({len(u.param_numels)})", fix)
        for name in ("fwd_time", "bwd_time", "fwd_time_one", "bwd_time_one"):
            _check_timing(getattr(u, name), f"{at}.{name}", where, fix)
        _check_saved_parts(u, at, where, fix)
        if u.tp is not None:
            _check_tp_unit(u, f"{at}.tp", where, fix)
    # model_profiler.profile_model: unassigned_params = total_params - sum(units' params), by construction
    assigned = sum(u.params for u in p.units)
    if p.total_params != assigned + p.unassigned_params:
        _fail(where, f"{path}.total_params", p.total_params,
              f"total_params = sum of units[].params + unassigned_params = {assigned + p.unassigned_params}", fix)
    # unassigned parameters have bytes in the total but in no unit, so only an inequality holds
    unit_bytes = sum(u.param_bytes for u in p.units)
    if unit_bytes > p.total_param_bytes:
        _fail(where, f"{path}.total_param_bytes", p.total_param_bytes,
              f"total_param_bytes >= sum of units[].param_bytes = {unit_bytes}", fix)
    for i, e in enumerate(p.edges):  # edges run from an earlier unit to a later one (profiling.units.data_flow_edges)
        if not 0 <= e.src < e.dst < len(p.units):
            _fail(where, f"{path}.edges[{i}]", f"{e.src} -> {e.dst}",
                  f"unit indices with src < dst < {len(p.units)}", fix)
    if p.pipelining and p.pipelining not in PIPELINE_KINDS and not p.pipelining.startswith("no: "):
        _fail(where, f"{path}.pipelining", p.pipelining,
              f"one of {', '.join(PIPELINE_KINDS)}, 'no: <reason>', or empty (not recorded)", fix)
    shape = p.tensor_parallel
    custom = shape is not None and shape.plan.startswith(CUSTOM) and bool(shape.rules)
    if shape is not None and shape.plan and shape.plan not in PLANS and not shape.plan.startswith("no: ") and not custom:
        _fail(where, f"{path}.tensor_parallel.plan", shape.plan,
              f"one of {', '.join(PLANS)}, 'custom: <module:function>' with its rules, or 'no: <reason>'", fix)
    if p.largest_unit not in names:
        _fail(where, f"{path}.largest_unit", p.largest_unit, "the name of one of the units", fix)
    _check_optimizer_timings(p, path, where, fix)
    for i, s in enumerate(p.shared):
        for j, unit in enumerate(s.units):
            if unit not in names:
                _fail(where, f"{path}.shared[{i}].units[{j}]", unit, "the name of one of the units", fix)


def _check_optimizer_timings(p: ModelProfile, path: str, where: str, fix: str) -> None:
    """The timed optimizer steps (profile.OptimizerTiming): a known optimizer over at least one parameter
    (compute.optimizer_step_time divides by params)."""
    for i, t in enumerate(p.optimizer_timings):
        at = f"{path}.optimizer_timings[{i}]"
        if t.optimizer not in OPTIMIZERS:
            _fail(where, f"{at}.optimizer", t.optimizer, f"one of {', '.join(OPTIMIZERS)}", fix)
        if t.params < 1 or t.tensors < 1:
            _fail(where, f"{at}.params", (t.params, t.tensors), "params >= 1 and tensors >= 1", fix)
        _check_timing(t.step, f"{at}.step", where, fix)


def _check_saved_parts(u: UnitProfile, at: str, where: str, fix: str) -> None:
    """A unit's parts of saved_bytes (profiling.counting.count_module) within it and each other."""
    if not 0 <= u.saved_fixed_bytes <= u.saved_bytes:   # a part of saved_bytes (profiling.counting)
        _fail(where, f"{at}.saved_fixed_bytes", u.saved_fixed_bytes, f"0 to saved_bytes ({u.saved_bytes})", fix)
    if not 0 <= u.saved_other_dtype_bytes <= u.saved_bytes:   # a part of saved_bytes (_count_module)
        _fail(where, f"{at}.saved_other_dtype_bytes", u.saved_other_dtype_bytes,
              f"0 to saved_bytes ({u.saved_bytes})", fix)
    # of the other-dtype bytes, the fixed part within the fixed bytes and the growing part within the growing ones
    low = max(0, u.saved_other_dtype_bytes - u.saved_bytes + u.saved_fixed_bytes)
    if not low <= u.saved_other_fixed_bytes <= min(u.saved_other_dtype_bytes, u.saved_fixed_bytes):
        _fail(where, f"{at}.saved_other_fixed_bytes", u.saved_other_fixed_bytes,
              f"{low} to {min(u.saved_other_dtype_bytes, u.saved_fixed_bytes)} (within saved_fixed_bytes, "
              f"and saved_other_dtype_bytes' growing part within the growing bytes)", fix)


def _check_tp_unit(u: UnitProfile, path: str, where: str, fix: str) -> None:
    """model_profiler gives every saved storage at most one role and flags each counted tensor once (TPUnit)."""
    t = u.tp
    assert t is not None   # the caller checks only units with a TP record
    roles = t.saved_split + t.saved_seq + t.saved_col_input + t.saved_core
    if roles > u.saved_bytes:
        _fail(where, f"{path}.saved_split", t.saved_split,
              f"the saved bytes by role ({roles}) <= the unit's saved_bytes ({u.saved_bytes})", fix)
    if t.param_split and len(t.param_split) != len(u.param_numels):
        _fail(where, f"{path}.param_split", list(t.param_split),
              f"one flag per parameter tensor ({len(u.param_numels)})", fix)
    for flag, field in ((1, "split_params"), (2, "vocab_params")):
        want = sum(n for n, f in zip(u.param_numels, t.param_split) if f == flag) if t.param_split else None
        if want is not None and getattr(t, field) != want:
            _fail(where, f"{path}.{field}", getattr(t, field), f"{field} = the flagged tensors' sizes ({want})", fix)
    if t.split_params + t.vocab_params > u.params:
        _fail(where, f"{path}.split_params", t.split_params, f"split_params + vocab_params <= params ({u.params})", fix)
