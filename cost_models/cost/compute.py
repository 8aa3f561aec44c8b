"""A unit's forward and backward time on the target device (pure functions).

Two sources, in order of trust:
  1. measured: the profile was taken in real mode on the device the cluster has (CPU ranks, or its GPU model), in
     the dtype the plan computes in (executed_dtype). Each unit
     was timed at the profile's micro-batch B and at one sample, giving t(b) = t1 + (tB - t1) (b - 1) / (B - 1):
     a fixed per-call cost (kernel launches, Python) plus per-sample work; with one timing only, t scales with b
     as FLOPs do. Times scale by the profile's in_model_factor (units timed alone run with a warm cache; the
     whole model timed end to end does not). On a GPU a factor below 1 is the other way round: each unit timed
     alone pays a synchronize and a cold launch queue that the whole model does not, a fixed cost per call, so
     above the profile's micro-batch the same seconds per call come off (_in_model) rather than the same share
     (measured on an H200: benchmarks/results/measurements.md, "GPU observations"; not re-measured with this
     reading).
     Then contention: a CPU rank that
     shares cores runs slower. The compute probe gives both sides: one rank alone does `flops_alone`, one of
     `ranks` running at once does `flops_per_rank`, so the machine has effectively
     cores_eff = ranks * flops_per_rank / flops_alone rank-threads, and N ranks slow each other by
     max(1, N / cores_eff). A profile taken with T threads runs T times slower on one thread (linear scaling,
     an approximation that overstates small kernels' slowdown).
  2. For a GPU target with no such times (a preset, from a CPU or meta profile): the unit's work by kind
     (profile.UnitProfile.fwd_work / bwd_work), each kind at its own rate (cost_models.cost.kernels: products by
     shape, fused attention, memory-bound bytes, kernel gaps), scaled linearly with the micro-batch except the
     kernel gaps. Profiles without that record (older files), and CPU targets: FLOPs / (device peak x matmul
     efficiency), the roofline's compute side, which memory-bound ops make optimistic.

Tensor parallelism over t ranks (tp_unit_times): the share f of a unit's FLOPs inside split modules (profile.TPUnit;
backward assumed split in the same share) runs on 1/t of the weights. Measured: the affine fit's fixed part (the
per-call cost at zero samples) stays whole and only the per-sample work of the split share is divided, which is
the measured loss of narrower GEMMs on this device. FLOPs: the split share runs at the efficiency of GEMMs 1/t as
wide, from Hockney's half-performance model r(n) = r_max n / (n + n_half) (Hockney & Jesshope 1988, "Parallel
Computers 2", section 1.3.3) over the narrowed dimension (hidden / t), with n_half = GEMM_N_HALF: 128, the width of
a tensor-core GEMM tile (NVIDIA, "Matrix Multiplication Background User's Guide": tile quantization), a stated
assumption, not a measurement (hidden 8192 at t = 8: 90% of the full width's rate).
"""
from __future__ import annotations

from typing import Literal, TypeVar

from cost_models.cost.kernels import KERNEL_GAP_S, Split, attention_seconds, work_seconds
from cost_models.cost.sharing import contention, memory_contention
from cost_models.records.cluster import ClusterProfile
from cost_models.records.profile import ModelProfile, UnitProfile

GEMM_N_HALF = 128   # columns per rank at which a GEMM runs at half its large-size rate (module doc)
_P = TypeVar("_P", bound=str)   # a precision: a Strategy's Literal one stays Literal through executed_precision


def executed_dtype(precision: str, device_kind: str) -> str:
    """The dtype a plan's units compute in: CPU ranks run every plan in fp32 (executor.zero.mixed_precision), GPUs
    in the plan's compute dtype."""
    return "fp32" if device_kind == "cpu" else compute_dtype(precision)


def executed_precision(precision: _P, device_kind: str) -> _P | Literal["fp32"]:
    """The precision a plan runs in: fp32 on CPU ranks (executed_dtype), the plan's own elsewhere."""
    return "fp32" if executed_dtype(precision, device_kind) == "fp32" else precision


def compute_dtype(precision: str) -> str:
    """The dtype activations are computed and kept in: fp32, or bf16 under mixed precision."""
    return "fp32" if precision == "fp32" else "bf16"


def uses_measured_times(profile: ModelProfile, cluster: ClusterProfile, precision: str) -> bool:
    """Measured times hold for the device and dtype they were measured in: CPU ranks, or GPUs of the profile's own
    model (an H200's times would mislead for an A100 cluster) computing in the profile's dtype: an fp32 plan
    priced from a bf16 profile ran several times its prediction (measured on an H200:
    benchmarks/results/measurements.md, "GPU observations"); the FLOPs route prices it at the probe's fp32 matmul
    rate."""
    return (_same_device(profile, cluster) and profile.dtype == executed_dtype(precision, cluster.device.kind)
            and all(u.fwd_time is not None for u in profile.units))


def compute_source(profile: ModelProfile, cluster: ClusterProfile, precision: str) -> str:
    """How a plan's units are priced (module doc): "measured" times, "kernels" (work by kind on a GPU) or "flops"."""
    if uses_measured_times(profile, cluster, precision):
        return "measured"
    return "kernels" if all(_by_kind(u, cluster) for u in profile.units) else "flops"


def _same_device(profile: ModelProfile, cluster: ClusterProfile) -> bool:
    """A real-mode profile taken on the cluster's kind of device (a GPU profile: on the same GPU model)."""
    same_gpu = profile.device != "gpu" or not profile.device_name or profile.device_name == cluster.device.name
    return profile.mode == "real" and profile.device == cluster.device.kind and same_gpu


def _measured_factor(profile: ModelProfile, cluster: ClusterProfile, ranks_running: float, mixed: bool) -> float:
    """A measured unit time's slowdown on a rank: contention, a profile taken with more threads than a rank has,
    and under torch's mixed precision (memory.torch_mixed) its casts and fp32 ops (profile.mixed_factor). The
    units' in-model factor is _in_model's."""
    mixed_factor = profile.mixed_factor if mixed else 1.0
    return contention(cluster, ranks_running) * _threads_factor(profile, cluster) * mixed_factor


def _threads_factor(profile: ModelProfile, cluster: ClusterProfile) -> float:
    """A profile timed with more threads than a rank gets runs that much slower on the rank (CPU ranks only: a
    GPU's kernels do not run slower for the host threads the probe's ranks were given)."""
    if cluster.device.kind != "cpu":
        return 1.0
    return max(1.0, profile.threads / (cluster.compute.threads_per_rank if cluster.compute else 1))


def _gap_per_call(profile: ModelProfile, cluster: ClusterProfile) -> bool:
    """Whether the profile's in-model factor is a fixed cost per call (a GPU's, below 1) rather than a share."""
    return cluster.device.kind == "gpu" and profile.in_model_factor < 1


def _in_model(seconds: float, at_profile: float, profile: ModelProfile, cluster: ClusterProfile) -> float:
    """A measured call of `seconds` (`at_profile`: the whole unit's at the profile's micro-batch) as it runs inside
    the whole model (module doc): scaled by profile.in_model_factor, or where that is a fixed cost per call less
    the seconds it took off a call at the profile's micro-batch, never below the scaled time (so below the
    profile's micro-batch it stays the share)."""
    f = profile.in_model_factor
    if not _gap_per_call(profile, cluster):
        return seconds * f
    return max(seconds - (1 - f) * at_profile, seconds * f)


def unit_times(unit: UnitProfile, profile: ModelProfile, cluster: ClusterProfile, *, micro_batch_size: int,
               precision: str, ranks_running: float, mixed: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch of `micro_batch_size` through `unit`; `mixed`: the plan runs
    in torch's mixed precision (memory.torch_mixed)."""
    scale = micro_batch_size / profile.micro_batch_size
    if uses_measured_times(profile, cluster, precision):
        factor = _measured_factor(profile, cluster, ranks_running, mixed)
        b0 = profile.micro_batch_size
        fwd, bwd = (_in_model(_at_batch(at, one, b0, micro_batch_size), _at_batch(at, one, b0, b0), profile,
                              cluster) * factor
                    for at, one in ((unit.fwd_time, unit.fwd_time_one), (unit.bwd_time, unit.bwd_time_one)))
        return fwd, bwd
    dtype = executed_dtype(precision, cluster.device.kind)
    if _by_kind(unit, cluster):
        return _kind_times(unit, cluster, dtype, scale, Split())
    peak = cluster.device.peak_flops.get(dtype) or max(cluster.device.peak_flops.values())
    rate = peak * cluster.device.matmul_efficiency
    return unit.fwd_flops * scale / rate, unit.bwd_flops * scale / rate


def priced_by_kind(unit: UnitProfile, profile: ModelProfile, cluster: ClusterProfile, precision: str) -> bool:
    """Whether unit_times prices `unit` by kind of work (not from measured times)."""
    return not uses_measured_times(profile, cluster, precision) and _by_kind(unit, cluster)


def _by_kind(unit: UnitProfile, cluster: ClusterProfile) -> bool:
    """Whether a unit is priced by kind of work (module doc, 2): a GPU target and a profile that recorded it."""
    return cluster.device.kind == "gpu" and unit.fwd_work is not None and unit.bwd_work is not None


def _kind_times(unit: UnitProfile, cluster: ClusterProfile, dtype: str, scale: float,
                split: Split) -> tuple[float, float]:
    """(forward, backward) by kind of work at `scale` times the profile's micro-batch; kernel gaps do not scale."""
    out = []
    for work, backward in ((unit.fwd_work, False), (unit.bwd_work, True)):
        assert work is not None   # _by_kind
        gaps = work.kernels * KERNEL_GAP_S
        out.append((work_seconds(work, cluster.device, dtype, backward=backward, split=split) - gaps) * scale + gaps)
    return out[0], out[1]


def tp_split(unit: UnitProfile, *, tp: int, vocab: bool, sp: bool) -> Split:
    """What tensor parallelism divides of a unit's work (cost.kernels.Split): the split share of its product FLOPs
    (split linears, and a vocabulary-split head when it splits), the attention by heads, and the share of its
    memory-bound bytes that runs on split tensors, read from where its saved bytes sit (profile.TPUnit's roles:
    inside the split region and the attention core always; norms, residual places and column inputs under SP; the
    loss's log-probabilities after a vocabulary-split head)."""
    tu, work = unit.tp, unit.fwd_work
    if tp == 1 or tu is None or work is None:
        return Split()
    gemm = (tu.split_flops + (tu.vocab_flops if vocab else 0) - tu.core_flops) / max(1, work.gemm_flops)
    kept = (tu.saved_split + tu.saved_core + (tu.saved_seq + tu.saved_col_input if sp else 0)
            + (tu.saved_logits if vocab else 0))
    return Split(tp=tp, gemm=min(1.0, max(0.0, gemm)), memory=min(1.0, kept / max(1, unit.saved_bytes)),
                 attention=tu.core_flops > 0)


def gemm_width_efficiency(width: int, tp: int) -> float:
    """Rate of a GEMM 1/tp as wide relative to the full width (Hockney's n_half model, module doc); 1 where unknown."""
    if tp == 1 or width <= 0:
        return 1.0
    narrow = width / tp
    return (narrow / (narrow + GEMM_N_HALF)) / (width / (width + GEMM_N_HALF))


def tp_unit_times(unit: UnitProfile, profile: ModelProfile, cluster: ClusterProfile, *, micro_batch_size: int,
                  precision: str, ranks_running: float, tp: int, vocab: bool,
                  mixed: bool = False, sp: bool = False) -> tuple[float, float, float]:
    """(forward, backward, attention-core forward) seconds of one micro-batch through `unit` on one of tp ranks
    (module doc), without the collectives; the core's forward is what selective recompute adds to the backward."""
    tu = unit.tp
    flops = max(1, unit.fwd_flops)
    split = min(1.0, (tu.split_flops + (tu.vocab_flops if vocab else 0)) / flops) if tu and tp > 1 else 0.0
    core = (tu.core_flops / flops) if tu else 0.0
    if uses_measured_times(profile, cluster, precision):
        factor = _measured_factor(profile, cluster, ranks_running, mixed)
        share = 1 - split + split / tp
        out, b0 = [], profile.micro_batch_size
        for at, one in ((unit.fwd_time, unit.fwd_time_one), (unit.bwd_time, unit.bwd_time_one)):
            fixed, work = affine_parts(at, one, b0, micro_batch_size)
            # a synchronize per call does not shrink with tp: the whole unit's gap at the profile's micro-batch
            out.append(_in_model(max(0.0, fixed + work * share), _at_batch(at, one, b0, b0), profile, cluster) * factor)
        fwd_work = affine_parts(unit.fwd_time, unit.fwd_time_one, b0, micro_batch_size)[1]
        # the attention core's work alone, recomputed inside a call: per-sample work, no gap of its own
        core_scale = 1.0 if _gap_per_call(profile, cluster) else profile.in_model_factor
        return out[0], out[1], fwd_work * core / tp * factor * core_scale
    if _by_kind(unit, cluster):
        dtype, scale = executed_dtype(precision, cluster.device.kind), micro_batch_size / profile.micro_batch_size
        parts = tp_split(unit, tp=tp, vocab=vocab, sp=sp)
        fwd, bwd = _kind_times(unit, cluster, dtype, scale, parts)
        assert unit.fwd_work is not None   # _by_kind
        return fwd, bwd, attention_seconds(unit.fwd_work, cluster.device, dtype, parts) * scale
    fwd, bwd = unit_times(unit, profile, cluster, micro_batch_size=micro_batch_size, precision=precision,
                          ranks_running=ranks_running, mixed=mixed)
    width = profile.tensor_parallel.hidden if profile.tensor_parallel else 0
    share = 1 - split + split / (tp * gemm_width_efficiency(width, tp))
    return fwd * share, bwd * share, fwd * core / (tp * gemm_width_efficiency(width, tp))


def affine_parts(at_profile, at_one, profile_batch: int, batch: int) -> tuple[float, float]:
    """A measured time at another micro-batch as (fixed part, per-sample work x batch): the line through the
    one-sample and the profile's timings (_one_sample), proportional to the batch where only one was taken."""
    if at_one is None or profile_batch <= 1:
        return 0.0, at_profile.median_s * batch / profile_batch
    one = _one_sample(at_profile, at_one)
    per_sample = (at_profile.median_s - one) / (profile_batch - 1)
    return one - per_sample, per_sample * batch


def _at_batch(at_profile, at_one, profile_batch: int, batch: int) -> float:
    """A measured time moved to another micro-batch size: affine through the two timings when both exist."""
    return sum(affine_parts(at_profile, at_one, profile_batch, batch))


def _one_sample(at_profile, at_one) -> float:
    """The one-sample timing the affine line starts from, never above the profile micro-batch's: where noise puts
    it above, the line is flat through the profile's own timing, so a plan at the profile's micro-batch is priced
    at exactly what was measured there (noise on a shared machine does put it above:
    benchmarks/results/measurements.md, "One-sample timing noise")."""
    return min(at_one.median_s, at_profile.median_s)


def optimizer_step_time(params: float, *, profile: ModelProfile, cluster: ClusterProfile, precision: str,
                        optimizer: str, ranks_running: float) -> float:
    """Adam/SGD update of `params` parameters on one of `ranks_running` busy ranks, beyond the fixed cost per
    tensor (the cluster's probe, estimate._optimizer_pass).

    Measured where the profile timed this optimizer on the cluster's device (profile.OptimizerTiming, same device
    rule as uses_measured_times but any precision: every plan updates fp32 weights), with caches flushed (in a
    step the forward and backward have evicted them), slowed by the ranks updating at once (memory_contention:
    the update is memory-bound, and slows with the ranks updating beside it: benchmarks/results/measurements.md,
    "Optimizer step timing"). Otherwise memory-bound, bytes touched / device memory bandwidth: read + write of
    one pass (Adam fp32 reads p, g, m, v and writes p, m, v: 28 B; bf16-mixed adds the bf16 copy: 30 B; SGD with
    momentum reads p, g, buf, writes p, buf: 20 B), a floor: torch's foreach AdamW makes eight passes.
    """
    timing = profile.optimizer_timing(optimizer)
    if timing is not None and _same_device(profile, cluster):
        return (params * timing.param_seconds() * _threads_factor(profile, cluster)
                * memory_contention(cluster, ranks_running))
    touched = 20 if optimizer == "sgd" else (30 if precision == "bf16-mixed" else 28)
    bw = cluster.device.memory_bandwidth_Bps
    return params * touched / bw if bw else 0.0
