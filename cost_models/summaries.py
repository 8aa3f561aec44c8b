"""Human-readable summaries of a model profile (rows of strings; the CLI renders them with rich)."""
from __future__ import annotations

import math

from cost_models.profile import ModelProfile, UnitProfile


def duration(seconds: float) -> str:
    """A duration in the unit that keeps it readable, 3 significant digits: 22.0 ns, 25.0 µs, 0.100 ms, 12.3 ms, 1.50 s,
    1,234 s (from 1,000 on, all integer digits). The one formatter for every time the CLI and the reports print, so
    a 20 µs step is not shown as "0.0 ms"."""
    if not math.isfinite(seconds):
        return f"{seconds} s"
    if seconds == 0:
        return "0 ms"
    if abs(seconds) < 1e-10:   # below 0.1 ns nothing is measured; print it exactly rather than as 0.0000220 ns
        return f"{seconds:.3g} s"
    rounded = float(f"{seconds:.3g}")   # round first, so 0.99996 s is "1.00 s", not "1,000 ms"
    mag = abs(rounded)
    scale, unit = ((1e9, "ns") if mag < 1e-7 else (1e6, "µs") if mag < 1e-4 else (1e3, "ms") if mag < 1
                   else (1.0, "s"))
    value = float(f"{rounded * scale:.3g}")
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f} {unit}"


def _timing(t) -> str:
    return "-" if t is None else duration(t.median_s)


def unit_rows(profile: ModelProfile, *, max_rows: int = 16) -> list[list[str]]:
    """One row per unit (the middle of a long block list elided), then a totals row."""
    def row(u: UnitProfile) -> list[str]:
        tied = " (tied)" if u.shared_params else ""
        return [u.name, f"{u.params:,}{tied}", f"{u.fwd_flops / 1e9:,.3f}", f"{u.bwd_flops / 1e9:,.3f}",
                f"{u.output_bytes / 2**20:,.2f}", f"{u.saved_bytes / 2**20:,.2f}", _timing(u.fwd_time), _timing(u.bwd_time)]
    units = list(profile.units)
    rows = [row(u) for u in units]
    if len(rows) > max_rows:
        keep = max_rows // 2
        rows = rows[:keep] + [[f"... {len(rows) - 2 * keep + 1} more units ..."] + [""] * 7] + rows[-keep + 1:]
    fwd_t = [u.fwd_time for u in units]
    total_time = (lambda ts: "-" if any(t is None for t in ts) else duration(sum(t.median_s for t in ts)))
    rows.append(["total", f"{profile.total_params:,}", f"{sum(u.fwd_flops for u in units) / 1e9:,.3f}",
                 f"{sum(u.bwd_flops for u in units) / 1e9:,.3f}", "", f"{sum(u.saved_bytes for u in units) / 2**20:,.2f}",
                 total_time(fwd_t), total_time([u.bwd_time for u in units])])
    return rows


UNIT_COLUMNS = ["unit", "params", "fwd GFLOP", "bwd GFLOP", "out MiB", "saved MiB", "fwd time", "bwd time"]


CLUSTER_FIT_COLUMNS = ["collective", "scope", "ranks", "alpha", "GB/s (S/beta)", "R^2", "sizes"]


def cluster_lines(c) -> list[str]:
    """Device, links and notes of a ClusterProfile, one line each."""
    d = c.device
    peaks = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in d.peak_flops.items())
    lines = [f"cluster: {c.name} ({c.source}): {c.nodes} node(s) x {c.devices_per_node} {d.kind}(s) = {c.world_size}",
             f"device: {d.name}, {d.memory_bytes / 2**30:.1f} GiB, peak {peaks}, matmul efficiency {d.matmul_efficiency:.2f}"]
    for label, link in (("intra-node", c.intra_node), ("inter-node", c.inter_node)):
        if link is not None:
            lines.append(f"{label}: {link.kind}, {link.bandwidth_Bps / 1e9:.3g} GB/s per device per direction, "
                         f"alpha {link.alpha_s * 1e6:.1f} us ({link.source})")
    if c.compute is not None:
        lines.append(f"compute probe: {c.compute.flops_per_rank / 1e9:.1f} GFLOP/s per rank with {c.compute.ranks} ranks busy, "
                     f"{c.compute.flops_alone / 1e9:.1f} alone ({c.compute.dtype}, n={c.compute.matmul_n})")
    if c.topology is not None:
        kinds = sorted({p.kind for p in c.topology.pairs})
        lines.append(f"topology: {len(c.topology.gpus)} GPUs, pairs over {', '.join(kinds)}"
                     + (", NVSwitch" if c.topology.nvswitch else ""))
    lines += [f"note: {n}" for n in c.notes]
    return lines


def cluster_fit_rows(c) -> list[list[str]]:
    rows = []
    for f in c.fits:
        sizes = f"{f.samples[0].size_bytes // 1024}K..{f.samples[-1].size_bytes // 2**20}M" if f.samples else ""
        bw = f"{1 / f.beta_s_per_byte / 1e9:.3f}" if f.beta_s_per_byte > 0 else "-"
        rows.append([f.op, f.scope, str(f.group_size), duration(f.alpha_s), bw, f"{f.r2:.3f}", sizes])
    return rows


MEMORY_COLUMNS = ["ranks", "stages", "params", "grads", "optimizer", "activations", "buffers", "overhead", "total", "fits"]


def _gib(b: float) -> str:
    return f"{b / 2**30:.3f}"


def memory_rows(est) -> list[list[str]]:
    """One row per group of ranks with identical memory (all dp ranks of a pipeline stage are alike)."""
    rows, groups = [], {}
    for m in est.memory_per_rank:
        key = (m.stages, m.parameters, m.gradients, m.optimizer_states, m.activations, m.buffers, m.overhead)
        groups.setdefault(key, []).append(m)
    for ms in groups.values():
        m = ms[0]
        ranks = f"{ms[0].rank}" if len(ms) == 1 else f"{ms[0].rank}-{ms[-1].rank}"
        rows.append([ranks, ",".join(map(str, m.stages)), _gib(m.parameters), _gib(m.gradients),
                     _gib(m.optimizer_states), _gib(m.activations), _gib(m.buffers), _gib(m.overhead),
                     _gib(m.total_bytes), "yes" if m.total_bytes <= est.capacity_bytes else "NO"])
    return rows


def estimate_lines(strategy, est) -> list[str]:
    s, b = strategy, est.breakdown
    shape = f"dp={s.dp} x pp={s.pp}" + (f" (v={s.v})" if s.v > 1 else "")
    lines = [f"strategy: {shape}, ZeRO-{s.zero}, {s.schedule}, {s.microbatches} micro-batches of {s.micro_batch_size}, "
             f"{s.precision}, {s.optimizer}",
             f"step time: {duration(est.step_time_s)} = compute {duration(b.compute_s)} + bubble {duration(b.bubble_s)}"
             f" + p2p {duration(b.p2p_s)} + data-parallel comm {duration(b.dp_comm_s)} + optimizer {duration(b.optimizer_s)}"
             f" ({est.compute_source} compute)",
             f"bubble: {est.bubble_ratio:.3f} of ideal compute ((p-1)/m convention), {est.bubble_share:.1%} of rank-time idle",
             f"throughput: {est.tokens_per_s:,.0f} {est.throughput_unit}/s" + (f", MFU {est.mfu:.1%}" if est.mfu is not None else ""),
             f"communication per step: p2p {est.comm.p2p_bytes_per_step / 2**20:,.2f} MiB ({est.comm.p2p_link}), "
             f"data-parallel {est.comm.dp_bytes_per_rank / 2**20:,.2f} MiB per rank ({est.comm.dp_link}: "
             + (", ".join(f"{k} {v / 2**20:,.2f}" for k, v in est.comm.dp_collectives.items()) or "none") + ")"]
    for st in est.stages:
        lines.append(f"stage {st.stage}: {st.units[0]}..{st.units[-1]} ({len(st.units)} units, {st.params:,} params), "
                     f"F {duration(st.fwd_s)}, B {duration(st.bwd_s)} per micro-batch, "
                     f"{st.peak_in_flight} in flight x {st.activation_bytes / 2**20:,.2f} MiB")
    return lines


def strategy_name(s) -> str:
    """Short name: 'ZeRO-3 dp=8, 4x2' or 'PP4 1f1b x DP2 ZeRO-1, 16x1 (+recompute)' (m x micro-batch size)."""
    shape = (f"ZeRO-{s.zero} dp={s.dp}" if s.pp == 1 else
             f"PP{s.pp} {s.schedule}" + (f" v={s.v}" if s.v > 1 else "") + (f" x DP{s.dp} ZeRO-{s.zero}" if s.dp > 1 else ""))
    rec = sum(s.recompute) if s.recompute else 0
    return f"{shape}, {s.microbatches}x{s.micro_batch_size}" + (f" +recompute {rec}/{s.n_stages}" if rec else "")
