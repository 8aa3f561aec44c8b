"""A unit's forward and backward time on the target device (pure functions).

Two sources, in order of trust:
  1. measured: the profile was taken in real mode on the device kind the cluster has (CPU ranks here). Each unit
     was timed at the profile's micro-batch B and at one sample, giving t(b) = t1 + (tB - t1) (b - 1) / (B - 1):
     a fixed per-call cost (kernel launches, Python) plus per-sample work; with one timing only, t scales with b
     as FLOPs do. Then contention: a CPU rank that
     shares cores runs slower. The compute probe gives both sides: one rank alone does `flops_alone`, one of
     `ranks` running at once does `flops_per_rank`, so the machine has effectively
     cores_eff = ranks * flops_per_rank / flops_alone rank-threads, and N ranks slow each other by
     max(1, N / cores_eff). A profile taken with T threads runs T times slower on one thread (linear scaling,
     an approximation that overstates small kernels' slowdown).
  2. FLOPs / (device peak x matmul efficiency) for any other target (a GPU preset from a CPU or meta profile).
     This is the roofline's compute side; memory-bound ops (norms, activations) make it optimistic.
"""
from __future__ import annotations

from cost_models.cluster import ClusterProfile
from cost_models.profile import ModelProfile, UnitProfile

COMPUTE_DTYPE = {"bf16-mixed": "bf16", "fp32": "fp32"}


def uses_measured_times(profile: ModelProfile, cluster: ClusterProfile) -> bool:
    return (profile.mode == "real" and profile.device == cluster.device.kind
            and all(u.fwd_time is not None for u in profile.units))


def contention(cluster: ClusterProfile, ranks_running: int) -> float:
    """How much slower each of `ranks_running` CPU ranks computes than one rank alone (1.0 on GPUs)."""
    c = cluster.compute
    if cluster.device.kind != "cpu" or c is None or c.flops_alone <= 0:
        return 1.0
    cores_eff = c.ranks * c.flops_per_rank / c.flops_alone
    return max(1.0, ranks_running / cores_eff)


def unit_times(unit: UnitProfile, profile: ModelProfile, cluster: ClusterProfile, *, micro_batch_size: int,
               precision: str, ranks_running: int) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch of `micro_batch_size` through `unit`."""
    scale = micro_batch_size / profile.micro_batch_size
    if uses_measured_times(profile, cluster):
        threads = profile.threads / (cluster.compute.threads_per_rank if cluster.compute else 1)
        factor = contention(cluster, ranks_running) * max(1.0, threads)
        return (_at_batch(unit.fwd_time, unit.fwd_time_one, profile.micro_batch_size, micro_batch_size) * factor,
                _at_batch(unit.bwd_time, unit.bwd_time_one, profile.micro_batch_size, micro_batch_size) * factor)
    dtype = COMPUTE_DTYPE.get(precision, "bf16")
    peak = cluster.device.peak_flops.get(dtype) or max(cluster.device.peak_flops.values())
    rate = peak * cluster.device.matmul_efficiency
    return unit.fwd_flops * scale / rate, unit.bwd_flops * scale / rate


def _at_batch(at_profile, at_one, profile_batch: int, batch: int) -> float:
    """A measured time moved to another micro-batch size: affine through the two timings when both exist."""
    if at_one is None or profile_batch <= 1:
        return at_profile.median_s * batch / profile_batch
    per_sample = max(0.0, (at_profile.median_s - at_one.median_s) / (profile_batch - 1))
    return max(0.0, at_one.median_s + per_sample * (batch - 1))


def optimizer_step_time(params: float, *, precision: str, optimizer: str, cluster: ClusterProfile) -> float:
    """Adam/SGD update of `params` parameters: memory-bound, bytes touched / device memory bandwidth.

    Bytes per parameter (read + write, PyTorch's foreach implementations): Adam fp32 reads p, g, m, v and writes
    p, m, v: 28 B; bf16-mixed adds the bf16 copy: 30 B; SGD with momentum reads p, g, buf, writes p, buf: 20 B.
    """
    touched = 20 if optimizer == "sgd" else (30 if precision == "bf16-mixed" else 28)
    bw = cluster.device.memory_bandwidth_Bps
    return params * touched / bw if bw else 0.0
