"""A pass's time on a GPU from its work by kind (records.work.WorkCounts), each kind at its own rate (pure functions).

Matrix products: at the device's largest achievable rate (DeviceSpec.matmul_efficiency x peak: the best shape a
search over shapes finds, the "maximum achievable matmul FLOPS"), less what the shape wastes on tiles. cuBLAS cuts
the output into tiles, pads a dimension that is not a multiple of the tile (tile quantization) and runs the tiles
in waves of one per SM, the last wave partly idle (wave quantization): NVIDIA, "Matrix Multiplication Background
User's Guide" (DU-09799-001, sections 2.3 and 3). The useful share is m n batch / (waves x SMs x tile area), taken
at the better of 256x128 and 128x128 tiles (the guide's typical cuBLAS tiles; its heuristics pick per shape). Never
faster than its bytes at the memory rate (the roofline's other side).
Fused attention: at the device's attention rates (DeviceSpec.attention_efficiency, forward and backward, from the
kernels' published benchmarks), over the FLOPs the kernel executes (a causal mask skips half: records.work).
Everything else is memory-bound: bytes read + written at memory_bandwidth x MEMORY_EFFICIENCY.
Kernels: each adds KERNEL_GAP_S, the idle time between back-to-back kernels in one stream.

Under tensor parallelism over t ranks (split, from profile.TPUnit): the split share of products runs with its
output width divided by t (rowwise products divide their depth instead; the tiles waste about the same), attention
by heads (1/t), and the memory-bound bytes' split share 1/t.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.records.cluster import DeviceSpec
from cost_models.records.work import Gemm, WorkCounts

# STREAM-style copy and triad kernels reach about this share of an HBM GPU's datasheet bandwidth (BabelStream,
# UoB-HPC/BabelStream, the benchmark HPC centres publish per GPU); elementwise PyTorch kernels on large tensors are
# of the same kind. A stated assumption, not measured by zeropipe.
MEMORY_EFFICIENCY = 0.85
# Back-to-back kernels in one CUDA stream leave about 1 us between them when the host launches ahead (NVIDIA
# Technical Blog, "Getting Started with CUDA Graphs": per-kernel time in a stream exceeded the kernel's own by
# about a microsecond, which graphs remove). A stated assumption of that order.
KERNEL_GAP_S = 1e-6
TILES = ((256, 128), (128, 128))   # cuBLAS's typical tiles (Matrix Multiplication Background, section 2.3)


@dataclass(frozen=True, kw_only=True)
class Split:
    """What tensor parallelism divides in one pass (module doc): over `tp` ranks, `gemm` and `memory` the shares of
    product FLOPs and memory-bound bytes that split, `attention` whether the attention splits by heads."""

    tp: int = 1
    gemm: float = 0.0
    memory: float = 0.0
    attention: bool = True


def tile_share(g: Gemm, sm_count: int) -> float:
    """The share of a product's tile slots doing useful work (module doc); 1 where the SM count is unknown."""
    if sm_count <= 0:
        return 1.0
    best = 0.0
    for tm, tn in TILES:
        tiles = math.ceil(g.m / tm) * math.ceil(g.n / tn) * g.batch
        waves = math.ceil(tiles / sm_count)
        best = max(best, g.m * g.n * g.batch / (waves * sm_count * tm * tn))
    return best


def gemm_seconds(g: Gemm, device: DeviceSpec, dtype: str) -> float:
    """`g.count` products of one shape: tile-quantized at the device's best matmul rate, never above the roofline."""
    rate = _peak(device, dtype) * device.matmul_efficiency * tile_share(g, device.sm_count)
    compute = g.flops / rate
    moved = g.count * g.batch * (g.m * g.k + g.k * g.n + g.m * g.n) * g.itemsize
    return max(compute, moved / _memory_rate(device))


def _narrowed(g: Gemm, tp: int) -> Gemm:
    """The same product on one of tp ranks: its output width divided (module doc)."""
    return Gemm(m=g.m, n=max(1, g.n // tp), k=g.k, batch=g.batch, count=g.count, itemsize=g.itemsize)


def _peak(device: DeviceSpec, dtype: str) -> float:
    return device.peak_flops.get(dtype) or max(device.peak_flops.values())


def _memory_rate(device: DeviceSpec) -> float:
    return device.memory_bandwidth_Bps * MEMORY_EFFICIENCY


def attention_rate(device: DeviceSpec, dtype: str, backward: bool) -> float:
    """FLOP/s of the fused attention kernels; the matmul rate where the device records none."""
    eff = device.attention_efficiency.get("bwd" if backward else "fwd") or device.matmul_efficiency
    return _peak(device, dtype) * eff


# work_seconds by pass: the planner prices the same units for thousands of candidates. Keyed by the records' ids,
# each record kept beside its result so that a reused id is told apart; cleared when it grows past a bound.
_CACHE: dict[int, tuple[WorkCounts, dict[tuple, tuple[DeviceSpec, float]]]] = {}
_CACHE_BOUND = 1 << 16


def work_seconds(work: WorkCounts, device: DeviceSpec, dtype: str, *, backward: bool,
                 split: Split = Split()) -> float:
    """One pass's seconds on one rank (module doc)."""
    entry = _CACHE.get(id(work))
    if entry is None or entry[0] is not work:
        if len(_CACHE) >= _CACHE_BOUND:
            _CACHE.clear()
        entry = _CACHE[id(work)] = (work, {})
    key = (id(device), dtype, backward, split)
    hit = entry[1].get(key)
    if hit is None or hit[0] is not device:
        hit = entry[1][key] = (device, _work_seconds(work, device, dtype, backward=backward, split=split))
    return hit[1]


def _work_seconds(work: WorkCounts, device: DeviceSpec, dtype: str, *, backward: bool, split: Split) -> float:
    tp = split.tp
    gemms = 0.0
    for g in work.gemms:
        whole = gemm_seconds(g, device, dtype)
        gemms += whole if tp == 1 else (1 - split.gemm) * whole + split.gemm * gemm_seconds(_narrowed(g, tp),
                                                                                            device, dtype)
    attention = attention_seconds(work, device, dtype, split, backward=backward)
    other = work.other_flops / (_peak(device, dtype) * device.matmul_efficiency)
    memory = work.memory_bytes * (1 - split.memory + split.memory / tp) / _memory_rate(device)
    return gemms + attention + other + memory + work.kernels * KERNEL_GAP_S


def attention_seconds(work: WorkCounts, device: DeviceSpec, dtype: str, split: Split = Split(), *,
                      backward: bool = False) -> float:
    """A pass's fused attention on one rank; the forward's is what selective recompute runs again in the backward."""
    return work.attention_flops / attention_rate(device, dtype, backward) / (split.tp if split.attention else 1)
