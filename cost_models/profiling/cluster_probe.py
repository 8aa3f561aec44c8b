"""Probe the cluster this runs on: collectives over torch.distributed, fitted alpha-beta, and a matmul rate.

Every rank runs `probe_worker`. Locally, `run_local_probe` starts the ranks with torchrun's own machinery
(torch.distributed.launcher.elastic_launch, c10d rendezvous on 127.0.0.1); across nodes, run this module under
torchrun on every node, and rank 0 writes the cluster file:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m cost_models.profiling.cluster_probe -o cluster.json

Groups measured: inside node 0, the first g ranks for g = 2, 4, ... up to the ranks per node ("intra"), while
every other block of g ranks of that node runs the same op at the same time (as a plan's groups do); across nodes,
one rank per node ("inter"). Each (op, group, size) is timed `repeats` times (at least
COLLECTIVE_REPEATS) after `warmup`, each repeat taken as the slowest member's time, and their mean kept, less the
slowest repeat (below). NCCL is used when GPUs are present, gloo otherwise.

Why the mean and not the median: a step issues many collectives and pays the sum of their times, whose expectation
is the sum of their means (linearity of expectation), whatever the distribution. On CPU ranks that share cores,
small collectives' times are heavy-tailed: about a quarter of the calls wait a scheduler time slice (the rank's
communication thread waits for a core), so the mean is several times the median; fitted on medians, the probe
priced a tensor-parallel step's all-reduces several times too cheap and the estimate's TP and pipeline steps came
out far short (measured: benchmarks/results/measurements.md, "Collective timing tails"). System noise acts on collectives through its tail,
not its median (Hoefler, Schneider, Lumsdaine, "Characterizing the Influence of System Noise on Large-Scale
Applications by Simulation", SC 2010; Petrini, Kerbyson, Pakin, "The Case of the Missing Supercomputer
Performance", SC 2003). The slowest repeat is still dropped: one burst from another process (which the median
used to absorb) should not set a size's cost. The median is kept beside the mean in the cluster file.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
from typing import Any, Literal

import psutil
import torch
import torch.distributed as dist

from cost_models.cost.memory import EXECUTOR_IMPORTS_BYTES
from cost_models.records.base import Record, record
from cost_models.records.cluster import (ClusterProfile, CollectiveFit, CollectiveOp, ComputeProbe, DeviceSpec,
                                         LinkSpec, Sample, Topology)
from cost_models.records.errors import ConfigError, ProfileError
from cost_models.records.fit import fit_alpha_beta
from cost_models.records.formatting import fixed
from cost_models.torch_compat.devices import claim_device, rank_backend
from cost_models.torch_compat.elastic import elastic_job, import_in_ranks, init_process_group, root_failure
from cost_models.torch_compat.host import background_runnable, peak_rss_bytes

KIB, MIB = 2**10, 2**20
# broadcast: ZeroRedundancyOptimizer sends each updated parameter tensor from its owner with one (its
# _broadcast_params_from_rank); over gloo it is not an all-gather's cost (below, _broadcast_run)
# all_to_all: expert parallelism's token dispatch (cost.moe), even splits: the full buffer is what each rank hands
# all_to_all_single
OPS = ("all_gather", "reduce_scatter", "all_reduce", "send_recv", "broadcast", "all_to_all")
# A broadcast is timed as ZeroRedundancyOptimizer issues them: a run of this many, async, each owner's in turn, then
# waited on; its time per call. Over gloo a run costs per call what a ZeRO-1 step's broadcasts do, where one
# broadcast at a time or an all-gather of the same bytes do not (measured: benchmarks/results/measurements.md,
# "Broadcast runs"). Buffers past RUN_BYTES go two at a
# time (bandwidth-bound: a longer run overlaps nothing more, and 8 x 64 MiB would slow the probe by seconds); the
# fit then mixes the two, its beta set mostly by the pairs.
BROADCAST_RUN, RUN_BYTES = 8, 4 * MIB
DEFAULT_SIZES = tuple(4 * KIB * 4**i for i in range(8))  # 4 KiB .. 64 MiB
# at least this many timed repeats per collective and size: with a tail of about 1 in 4 repeats (module doc), 12
# give the mean to within about a quarter, for a few seconds more probe time than 5 repeats (measured:
# benchmarks/results/measurements.md, "Collective timing tails")
COLLECTIVE_REPEATS = 12


@record
class ProbeConfig(Record):
    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 5
    warmup: int = 1
    ops: tuple[str, ...] = OPS
    dtype: str = "fp32"
    matmul_n: int = 0                 # 0: 512 on CPU, 8192 on GPU
    matmul_seconds: float = 0.5
    timeout_s: float = 120.0


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _group_sizes(local_world: int) -> list[int]:
    sizes, g = [], 2
    while g <= local_world:
        sizes.append(g)
        g *= 2
    if local_world >= 2 and local_world not in sizes:
        sizes.append(local_world)
    return sizes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # torch 2.13 marks all_gather_into_tensor / reduce_scatter_tensor @deprecated in favour of all_gather_single /
    # reduce_scatter_single (torch/distributed/distributed_c10d.py); older torch has only the former.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def _buffer_numel(size: int, group_size: int) -> int:
    """fp32 elements of a `size`-byte buffer, rounded down to a multiple of the group size (at least one each)."""
    numel = max(size // 4, group_size)
    return numel - numel % group_size


def _time_op(op: str, sizes: tuple[int, ...], members: list[int], group, cfg: ProbeConfig,
             device: torch.device) -> list[list[float]]:
    """Seconds on this rank, [repeat][size]. Repeats are the outer loop so that a burst of noise from other
    processes (on shared cores) spoils one repeat of every size, which the median then drops, instead of
    every repeat of one size. Buffers are fp32; a size is the full buffer's bytes."""
    rank, g = dist.get_rank(), len(members)
    peer = members[1] if rank == members[0] else members[0]
    buffers = [(torch.ones(_buffer_numel(s, g), device=device), torch.ones(_buffer_numel(s, g) // g, device=device))
               for s in sizes]
    # a broadcast run sends distinct tensors, as the optimizer's are (one buffer 8 times would stay in cache)
    runs = [[full, *(torch.ones_like(full) for _ in range(_run_length(full) - 1))] if op == "broadcast"
            else [full, torch.empty_like(full)] if op == "all_to_all" else [full] for full, _ in buffers]
    out = []
    for i in range(cfg.warmup + _collective_repeats(cfg)):
        row = []
        for (full, part), run in zip(buffers, runs):
            dist.barrier(group=group)
            _sync(device)
            t0 = time.perf_counter()
            if op == "all_gather":
                _all_gather(full, part, group)
            elif op == "reduce_scatter":
                _reduce_scatter(part, full, group)
            elif op == "all_reduce":
                dist.all_reduce(full, group=group)
            elif op == "broadcast":   # a run (BROADCAST_RUN): elapsed is per call
                _broadcast_run(run, members, group)
            elif op == "all_to_all":   # into the second of the run's buffers (a copy of the full one's shape)
                dist.all_to_all_single(run[-1], full, group=group)
            else:  # send_recv: ping-pong between the two members, one-way time = round trip / 2
                if rank == members[0]:
                    dist.send(full, peer)
                    dist.recv(full, peer)
                else:
                    dist.recv(full, peer)
                    dist.send(full, peer)
            _sync(device)
            elapsed = time.perf_counter() - t0
            row.append(elapsed / 2 if op == "send_recv" else elapsed / len(run) if op == "broadcast" else elapsed)
        if i >= cfg.warmup:
            out.append(row)
    return out


def _run_length(full: torch.Tensor) -> int:
    """How many broadcasts of a buffer like `full` one run issues (BROADCAST_RUN, two past RUN_BYTES)."""
    return BROADCAST_RUN if full.numel() * full.element_size() <= RUN_BYTES else 2


def _broadcast_run(run: list[torch.Tensor], members: list[int], group) -> None:
    """Broadcast each tensor of `run`, async, the members owning consecutive blocks of it in turn, as
    ZeroRedundancyOptimizer's _sync_params does; wait for all. Every rank issues the same calls in the same order."""
    n = len(run)
    owners = [members[i * len(members) // n] for i in range(n)]
    for handle in [dist.broadcast(t, src=src, group=group, async_op=True) for t, src in zip(run, owners)]:
        handle.wait()


def _collective_repeats(cfg: ProbeConfig) -> int:
    return max(cfg.repeats, COLLECTIVE_REPEATS)


def expected_seconds(times: list[float]) -> float:
    """What one more call is expected to take (module doc): the mean of the repeats, less the slowest when there are
    four or more (one burst from another process is not this op's cost)."""
    kept = sorted(times)[:-1] if len(times) >= 4 else list(times)
    return statistics.fmean(kept)


def _matmul_rate(n: int, dtype: torch.dtype, seconds: float, device: torch.device) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    _sync(device)
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        iters += 1
    _sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def _copy_rate(numel: int, seconds: float, device: torch.device) -> float:
    """Bytes read + written per second by dst.copy_(src) on `numel` fp32 elements (a memory-bound kernel)."""
    src, dst = torch.ones(numel, device=device), torch.empty(numel, device=device)
    dst.copy_(src)
    _sync(device)
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        dst.copy_(src)
        iters += 1
    _sync(device)
    return 2 * numel * 4 * iters / (time.perf_counter() - t0)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """NCCL reduces only device tensors; gloo takes the CPU tensor as it is."""
    return t.to(device) if device.type == "cuda" else t


def _probe_groups(world: int, local_world: int) -> list[tuple[str, list[int]]]:
    """(scope, members): the first g ranks of node 0 for each intra-node size, and one rank per node across nodes."""
    groups = [("intra", list(range(g))) for g in _group_sizes(local_world)]
    if world // local_world > 1:
        groups.append(("inter", [n * local_world for n in range(world // local_world)]))
    return groups


def _siblings(scope: str, members: list[int], local_world: int) -> list[list[int]]:
    """The disjoint groups that run the same collective at the same time as `members`: inside a node, every block
    of that many consecutive ranks, as a plan's TP or data-parallel groups all communicate at once (timed alone,
    the other ranks idle, a group of CPU ranks sharing cores came out several times faster than it runs in a plan,
    and the planner picked such a plan far from the best measured: benchmarks/results/measurements.md, "Sibling
    groups and p2p"); across nodes, `members` alone."""
    if scope != "intra":
        return [members]
    g = len(members)
    return [list(range(i, i + g)) for i in range(0, local_world - g + 1, g)]


def _measure_collectives(cfg: ProbeConfig, groups: list[tuple[str, list[int]]], local_world: int,
                         device: torch.device) -> list[dict[str, Any]]:
    """One row per (op, scope, group size, buffer size): the expected time over repeats of the slowest member's
    time (expected_seconds), and their median; every sibling group (_siblings) runs the op at the same time."""
    rank = dist.get_rank()
    # new_group is collective over the whole world: every rank creates every group, in the same order.
    handles = []
    for scope, members in groups:
        siblings = _siblings(scope, members, local_world)
        handles.append([(sib, dist.new_group(ranks=sib), dist.new_group(ranks=sib[:2])) for sib in siblings])
    raw: list[dict[str, Any]] = []
    for (scope, members), sibling_groups in zip(groups, handles):
        for op in cfg.ops:
            if op == "send_recv" and scope == "intra" and len(members) != 2:
                continue  # p2p is pairwise: measured once per scope
            local = torch.zeros(_collective_repeats(cfg), len(cfg.sizes), dtype=torch.float64)
            # p2p alone: a pipeline's stage ranks hand over in turn, and timed beside its sibling pairs on CPU
            # ranks sharing cores it cost several times what pipeline steps showed (measured:
            # benchmarks/results/measurements.md, "Sibling groups and p2p")
            for sib, group, pair_group in sibling_groups[:1] if op == "send_recv" else sibling_groups:
                active, active_group = (sib[:2], pair_group) if op == "send_recv" else (sib, group)
                if rank in active:
                    local = torch.tensor(_time_op(op, cfg.sizes, active, active_group, cfg, device),
                                         dtype=torch.float64)
            active = members[:2] if op == "send_recv" else members
            # slowest member per repeat: a collective is done when its last rank is done
            slowest = _on(local, device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            per_size = slowest.cpu().t().tolist()
            for size, times in zip(cfg.sizes, per_size):
                raw.append({"op": op, "scope": scope, "group_size": len(active),
                            "size_bytes": _buffer_numel(size, len(active)) * 4,
                            "seconds": expected_seconds(times), "median_s": statistics.median(times),
                            "spread_s": max(times) - min(times)})
    return raw


def _measure_compute(cfg: ProbeConfig, device: torch.device) -> dict[str, Any]:
    """Matmul rate of every rank with all busy and of rank 0 alone, and every rank's copy bandwidth."""
    dtype = _DTYPES[cfg.dtype] if device.type == "cuda" else torch.float32   # CPU ranks run every plan in fp32
    n = cfg.matmul_n or (8192 if device.type == "cuda" else 512)
    dist.barrier()
    together = _gathered(_matmul_rate(n, dtype, cfg.matmul_seconds, device), device)
    alone = _matmul_rate(n, dtype, cfg.matmul_seconds, device) if dist.get_rank() == 0 else 0.0
    dist.barrier()
    # GPUs also in fp32 (plans in fp32 compute there, at a fraction of the bf16 rate; torch leaves TF32 off);
    # CPU ranks probe fp32 already
    on_gpu = device.type == "cuda" and dtype != torch.float32
    fp32s = _gathered(_matmul_rate(n, torch.float32, cfg.matmul_seconds, device) if on_gpu else 0.0, device)
    # 64 MiB per buffer: far beyond any cache, so this is DRAM / HBM bandwidth with all ranks copying.
    copies = _gathered(_copy_rate(16 * MIB, cfg.matmul_seconds, device), device)
    # and rank 0 alone: how far ranks slow each other's memory-bound work (sharing.memory_contention): one core's
    # copy can take most of a host's memory bandwidth (measured: benchmarks/results/measurements.md, "Memory
    # bandwidth contention")
    copy_alone = _copy_rate(16 * MIB, cfg.matmul_seconds, device) if dist.get_rank() == 0 else 0.0
    dist.barrier()
    return {"matmul_n": n, "flops_together": together, "flops_alone": alone, "copy_Bps": copies,
            "copy_alone_Bps": copy_alone,
            "flops_fp32_together": fp32s}


def _gathered(value: float, device: torch.device) -> list[float]:
    """Every rank's `value`, in rank order (collective; the tensors on the GPU for NCCL), then a barrier."""
    parts = [_on(torch.zeros(1, dtype=torch.float64), device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, _on(torch.tensor([value], dtype=torch.float64), device))
    dist.barrier()
    return [float(t.item()) for t in parts]


def _intra_fits(raw: list[dict[str, Any]]) -> dict[tuple[str, int], tuple[float, float]]:
    """(alpha, beta) per intra-node (op, group size) with more than one size: what the overhead probe subtracts."""
    series: dict[tuple[str, int], list] = {}
    for r in raw:
        if r["scope"] == "intra":
            series.setdefault((r["op"], r["group_size"]), []).append((r["size_bytes"], r["seconds"]))
    return {k: fit_alpha_beta([a for a, _ in v], [b for _, b in v])[:2] for k, v in series.items() if len(v) > 1}


import_in_ranks(__name__)   # probe_worker, the ranks' entry point


def _probe_rank_rss() -> int:
    """This rank's peak RSS as a probe rank's (ComputeProbe.rank_rss_bytes, to which memory.overhead_bytes adds the
    executor's imports). A rank forked from a rank server that also imported the executor (a launcher that runs
    both, elastic.start_rank_server) holds those imports already: they are taken off, not counted twice. A forked
    rank's RSS holds only the library pages it has run (fork copies no page table entries of file mappings: Linux
    mm/memory.c, copy_page_range), so the rank first runs what every training rank runs on a tiny layer (a forward,
    a backward and an AdamW step), as a spawned one had them mapped by its own imports."""
    layer = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    rss = peak_rss_bytes()[0]
    return rss - EXECUTOR_IMPORTS_BYTES if "executor.launch" in sys.modules else rss


def probe_worker(cfg_data: dict[str, Any]) -> dict[str, Any] | None:
    """Run on every rank (env:// rendezvous). Returns the raw measurements on global rank 0, None elsewhere."""
    from cost_models.profiling.overhead_probe import overhead_probe

    cfg = ProbeConfig.from_dict(cfg_data)
    device = claim_device(one_thread=True)   # ranks share the host's cores: one thread each, as executor ranks
    use_cuda = device.type == "cuda"
    backend = rank_backend()
    init_process_group(backend, cfg.timeout_s)
    baseline = 0 if use_cuda else _probe_rank_rss()   # before the probe's own buffers
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        raw = _measure_collectives(cfg, _probe_groups(world, local_world), local_world, device)
        compute = _measure_compute(cfg, device)
        overheads = overhead_probe(device, _intra_fits(raw))
        if rank != 0:
            return None
        return {"raw": raw, "world": world, "local_world": local_world, "nodes": world // local_world,
                "backend": backend, "device_name": torch.cuda.get_device_name(device) if use_cuda else _cpu_name(),
                "device_memory": torch.cuda.get_device_properties(device).total_memory if use_cuda else None,
                **compute, "overheads": overheads, "threads_per_rank": torch.get_num_threads(),
                "rank_rss_bytes": baseline}
    finally:
        dist.destroy_process_group()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def run_local_probe(ranks: int, cfg: ProbeConfig) -> dict[str, Any]:
    """Start `ranks` local processes with torchrun's elastic launcher and return rank 0's measurements."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if ranks < 1:
        raise ConfigError(f"--ranks must be >= 1, got {ranks}")
    before = background_runnable()   # before the ranks start and after they end: only other programs' tasks
    try:
        with elastic_job("probe", ranks) as (start, _):
            results = start(probe_worker, cfg.to_dict())
    except ChildFailedError as exc:
        rank, line = root_failure(exc)
        raise ProfileError(f"the cluster probe failed on rank {rank}: {line}") from None
    # the load that lasted through the probe: one that ended while it ran (or started after) is not the machine's
    after = background_runnable()
    return {**results[0], "background_runnable": min(before, after), "background_seen": (before, after),
            "host_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)}


def _fits(raw: list[dict[str, Any]]) -> list[CollectiveFit]:
    """One alpha-beta fit per (op, scope, group size) series of the probe's rows."""
    # the rows _measure_collectives writes name an op of cfg.ops and a scope of the groups: CollectiveFit's names
    series: dict[tuple[CollectiveOp, Literal["intra", "inter"], int], list[dict[str, Any]]] = {}
    for r in raw:
        series.setdefault((r["op"], r["scope"], r["group_size"]), []).append(r)
    fits = []
    for (op, scope, g), rows in series.items():
        alpha, beta, r2 = fit_alpha_beta([r["size_bytes"] for r in rows], [r["seconds"] for r in rows])
        fits.append(CollectiveFit(op=op, group_size=g, scope=scope, alpha_s=alpha, beta_s_per_byte=beta, r2=r2,
                                  samples=tuple(Sample(size_bytes=r["size_bytes"], seconds=r["seconds"],
                                                       spread_s=r["spread_s"], median_s=r.get("median_s"))
                                                for r in rows)))
    return fits


def build_cluster_profile(raw: dict[str, Any], *, topology: Topology | None, notes: list[str], dtype: str) -> ClusterProfile:
    """Fit every (op, scope, group) series and describe the device and links the fits imply."""
    from cost_models.records.presets import PRESETS

    fits = _fits(raw["raw"])
    gpu = raw["backend"] == "nccl"
    dtype = dtype if gpu else "fp32"   # CPU ranks probe (and run) fp32 whatever was asked (_measure_compute)
    together = statistics.median(raw["flops_together"])
    compute = ComputeProbe(dtype=dtype, matmul_n=raw["matmul_n"], ranks=raw["world"],
                           threads_per_rank=raw["threads_per_rank"], flops_per_rank=together, flops_alone=raw["flops_alone"],
                           copy_Bps=statistics.median(raw["copy_Bps"]), copy_alone_Bps=raw.get("copy_alone_Bps", 0.0),
                           rank_rss_bytes=raw.get("rank_rss_bytes", 0),
                           background_runnable=0.0 if gpu else raw.get("background_runnable", 0.0),
                           host_cores=0 if gpu else raw.get("host_cores", 0),
                           **raw.get("overheads", {}))
    local_world = raw["local_world"]
    known = next((p.device for p in PRESETS.values() if gpu and p.device.name.split("-")[0] in raw["device_name"]), None)
    if known is not None and dtype in known.peak_flops:
        device = DeviceSpec(name=raw["device_name"], kind="gpu", memory_bytes=int(raw["device_memory"]),
                            peak_flops=dict(known.peak_flops), matmul_efficiency=together / known.peak_flops[dtype],
                            source=f"{known.source}; efficiency measured by the compute probe",
                            memory_bandwidth_Bps=known.memory_bandwidth_Bps)
    else:
        mem = int(raw["device_memory"]) if gpu else psutil.virtual_memory().total // local_world
        rates = {dtype: together}
        fp32 = statistics.median(raw.get("flops_fp32_together") or [0.0])
        if fp32 > 0:
            rates["fp32"] = fp32
        device = DeviceSpec(name=raw["device_name"], kind="gpu" if gpu else "cpu", memory_bytes=mem,
                            peak_flops=rates, matmul_efficiency=1.0,
                            source="measured: matmul rate of one rank while all ranks run (no datasheet peak)",
                            memory_bandwidth_Bps=compute.copy_Bps)
        if not gpu:
            notes.extend(_cpu_notes(compute, local_world, mem, seen=tuple(raw.get("background_seen", ()))))
    links = {}
    for scope in ("intra", "inter"):
        p2p = next((f for f in fits if f.op == "send_recv" and f.scope == scope), None)
        if p2p is None or p2p.beta_s_per_byte <= 0:
            continue
        if not gpu:
            kind = "gloo-loopback"
        elif scope == "inter":
            kind = "network"
        else:
            pair = next((p for p in topology.pairs if (p.a, p.b) == (0, 1)), None) if topology else None
            kind = pair.kind if pair else "unknown"
        links[scope] = LinkSpec(kind=kind, bandwidth_Bps=1.0 / p2p.beta_s_per_byte, alpha_s=p2p.alpha_s,
                                source=f"measured: send/recv fit, R^2 {p2p.r2:.3f}")
    if "intra" not in links and raw["world"] == 1:
        links["intra"] = _unmeasured_link(gpu)
        notes.append(f"one {'GPU' if gpu else 'rank'} here: no collective or link to measure (intra-node: nominal)")
    if "intra" not in links:
        raise ProfileError("the probe could not fit point-to-point bandwidth; rerun with more --probe-sizes")
    return ClusterProfile(name=f"local ({raw['world']} x {device.name})", source="probe", nodes=raw["nodes"],
                          devices_per_node=local_world, device=device, intra_node=links["intra"],
                          inter_node=links.get("inter"), fits=tuple(sorted(fits, key=lambda f: (f.scope, f.op, f.group_size))),
                          topology=topology, compute=compute, backend=raw["backend"], notes=tuple(notes))


def _cpu_notes(compute: ComputeProbe, local_world: int, mem: int, *, seen: tuple[float, ...] = ()) -> list[str]:
    """What CPU ranks share: the host's cores and memory, and where other programs' runnable tasks changed during
    the probe (`seen`: counted before and after; the lesser is priced, and planner.summaries.cluster_conditions
    says how)."""
    notes = [f"CPU ranks: {local_world} ranks share {os.cpu_count()} cores and "
             f"{fixed(psutil.virtual_memory().total, 'GiB', 1)}; each rank gets "
             f"{fixed(compute.flops_per_rank, 'GFLOP/s', 1)} ({compute.dtype} matmul, all ranks busy; "
             f"{fixed(compute.flops_alone, 'GFLOP/s', 1, show_unit=False)} alone) and {fixed(mem, 'GiB', 1)}"]
    if len(seen) == 2 and seen[0] != seen[1]:
        notes.append(f"other programs' runnable tasks changed during the probe ({seen[0]:g} before, {seen[1]:g} "
                     f"after): the {min(seen):g} that lasted are priced")
    return notes


def _unmeasured_link(gpu: bool) -> LinkSpec:
    """The link of a one-device machine, which has no peer to measure against: plans for that one device never
    use it; a plan scaled past it (--nodes) prices it as PCIe 4.0 (cost_models.records.presets.PCIE4, cited there), the
    slowest intra-node link a GPU server has. CPU ranks keep gloo's loopback kind."""
    from cost_models.records.presets import PCIE4
    return dataclasses.replace(PCIE4, kind=PCIE4.kind if gpu else "gloo-loopback",
                               source=f"not measured (no second device): {PCIE4.source}")


def main(argv: list[str] | None = None) -> None:
    """Entry point under torchrun for multi-node probes: every rank runs it, rank 0 writes the cluster file."""
    from cost_models.profiling.nvml_topology import detect_topology
    from cost_models.records.fileio import dumps, write_atomic
    from cost_models.records.files import ClusterFile

    ap = argparse.ArgumentParser(prog="python -m cost_models.profiling.cluster_probe",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", default="cluster.json")
    ap.add_argument("--dtype", default="bf16" if torch.cuda.is_available() else "fp32", choices=list(_DTYPES))
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    cfg = ProbeConfig(dtype=args.dtype)
    raw = probe_worker(cfg.to_dict())
    if raw is not None:
        topology, note = detect_topology()
        prof = build_cluster_profile(raw, topology=topology, notes=[note] if note else [], dtype=args.dtype)
        write_atomic(args.output, dumps(ClusterFile(cluster=prof).to_dict()), overwrite=args.force)
        print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
