"""Human-readable summaries of a model profile (rows of strings; the CLI renders them with rich)."""
from __future__ import annotations

from collections.abc import Sequence

from cost_models.cost.comm import dp_wire_bytes
from cost_models.cost.memory import MemoryBreakdown
from cost_models.cost.lengths import length_line
from cost_models.cost.sharing import contention
from cost_models.records.cluster import ClusterProfile
from cost_models.records.formatting import duration, fixed, flop_rate, rate, size
from cost_models.records.published import implausible_mfu
from cost_models.records.profile import ModelProfile, UnitProfile


def _timing(t) -> str:
    return "-" if t is None else duration(t.median_s)


def _gflop(flops: float) -> str:
    return fixed(flops, "GFLOP", 3, show_unit=False)


def _mib(n_bytes: float) -> str:
    return fixed(n_bytes, "MiB", show_unit=False)


def unit_rows(profile: ModelProfile, *, max_rows: int = 16) -> list[list[str]]:
    """One row per unit (the middle of a long block list elided), then a totals row."""
    def row(u: UnitProfile) -> list[str]:
        tied = " (tied)" if u.shared_params else ""
        return [u.name, f"{u.params:,}{tied}", _gflop(u.fwd_flops), _gflop(u.bwd_flops), _mib(u.output_bytes),
                _mib(u.saved_bytes), _timing(u.fwd_time), _timing(u.bwd_time)]
    units = list(profile.units)
    rows = [row(u) for u in units]
    if len(rows) > max_rows:
        keep = max_rows // 2
        rows = rows[:keep] + [[f"... {len(rows) - 2 * keep + 1} more units ..."] + [""] * 7] + rows[-keep + 1:]
    fwd_t = [u.fwd_time for u in units]
    total_time = (lambda ts: "-" if any(t is None for t in ts) else duration(sum(t.median_s for t in ts)))
    rows.append(["total", f"{profile.total_params:,}", _gflop(sum(u.fwd_flops for u in units)),
                 _gflop(sum(u.bwd_flops for u in units)), "", _mib(sum(u.saved_bytes for u in units)),
                 total_time(fwd_t), total_time([u.bwd_time for u in units])])
    return rows


UNIT_COLUMNS = ["unit", "params", "fwd GFLOP", "bwd GFLOP", "out MiB", "saved MiB", "fwd time", "bwd time"]


CLUSTER_FIT_COLUMNS = ["collective", "scope", "ranks", "alpha", "GB/s (S/beta)", "R^2", "sizes"]


def profile_conditions(profile: ModelProfile) -> tuple[str, ...]:
    """Provenance.profile_conditions: the load while the units were timed, the profiler's timing notes, and the
    length the profile was measured at where it was seen at another (cost.lengths)."""
    lines = (profile_load_line(profile), *profile.timing_notes, length_line(profile))
    return tuple(line for line in lines if line)


def cluster_conditions(cluster: ClusterProfile) -> tuple[str, ...]:
    """What a probe of CPU ranks saw beside it: other programs' runnable tasks (ComputeProbe.background_runnable),
    and the share of its speed alone each rank keeps with every rank computing, as the estimate prices it
    (cost.sharing.contention: processor sharing). () on GPUs, without a probe, or with nothing beside it."""
    c = cluster.compute
    if cluster.device.kind != "cpu" or c is None or c.background_runnable <= 0:
        return ()
    return (f"{c.background_runnable:g} runnable task(s) of other programs beside the cluster probe, priced as "
            f"sharing the cores with the ranks: with all {c.ranks} ranks computing, each at "
            f"{1 / contention(cluster, c.ranks):.0%} of its speed alone",)


def routing_line(profile: ModelProfile) -> str | None:
    """The MoE units' measured load per expert, where `planner profile --init-from --data` measured it: the
    busiest expert's share over the mean, per unit."""
    if not profile.routing:
        return None
    loads = [u.moe.expert_load for u in profile.moe_units if u.moe is not None]
    shares = [max(load) * len(load) / total for load in loads if (total := sum(load)) > 0]
    return (f"routing: load per expert measured on {profile.routing}; the busiest expert takes "
            f"x{min(shares):.2f}-x{max(shares):.2f} the mean across {len(shares)} MoE unit(s)" if shares else None)


def profile_load_line(profile: ModelProfile) -> str | None:
    """How loaded the machine was while a real profile timed its units (ModelProfile.load_1min and
    runnable_beside), or None where it was not recorded."""
    if not profile.load_1min or not profile.cpus:
        return None
    lo, hi = min(profile.load_1min), max(profile.load_1min)
    if not profile_loaded(profile):
        verdict = "below the CPU count"
    elif profile.clock == "thread-cpu":
        verdict = ("more runnable work than CPUs: the units were timed by their thread's CPU time, which leaves out "
                   "waiting for a core (the cores' sharing with other programs is priced from the cluster probe); "
                   "to check the prediction, `planner calibrate` from a run")
    else:
        verdict = ("more runnable work than CPUs: the unit times include waiting for a core, and every step "
                   "predicted from them with it; re-profile on a quieter machine or `planner calibrate` from a run")
    beside = ""
    if len(profile.runnable_beside) == 2:
        before, after = profile.runnable_beside
        beside = f", other programs' runnable tasks {before:g} before and {after:g} after"
    return (f"machine load while timing the units (1-minute average): {lo:.1f} to {hi:.1f} on {profile.cpus} CPUs"
            f"{beside}; {verdict}")


def profile_loaded(profile: ModelProfile) -> bool:
    """Whether a real profile's units were timed with more runnable work than CPUs: by the 1-minute load average,
    or by other programs' runnable tasks that lasted through the timing beside the profiler's own threads (the
    average lags a load that just started)."""
    if profile.cpus <= 0:
        return False
    averaged = bool(profile.load_1min) and max(profile.load_1min) > profile.cpus
    beside = min(profile.runnable_beside, default=0.0) + max(1, profile.threads)   # the profiler's threads too
    return averaged or (bool(profile.runnable_beside) and beside > profile.cpus)


def cluster_lines(c) -> list[str]:
    """Device, links and notes of a ClusterProfile, one line each."""
    d = c.device
    peaks = ", ".join(f"{k} {flop_rate(v)}" for k, v in d.peak_flops.items())
    lines = [f"cluster: {c.name} ({c.source}): {c.nodes} node(s) x {c.devices_per_node} {d.kind}(s) = {c.world_size}",
             f"device: {d.name}, {size(d.memory_bytes)}, peak {peaks}, matmul efficiency {d.matmul_efficiency:.2f}"]
    for label, link in (("intra-node", c.intra_node), ("inter-node", c.inter_node)):
        if link is not None:
            lines.append(f"{label}: {link.kind}, {rate(link.bandwidth_Bps)} per device per direction, "
                         f"alpha {duration(link.alpha_s)} ({link.source})")
    if c.compute is not None:
        lines.append(f"compute probe: {flop_rate(c.compute.flops_per_rank)} per rank with {c.compute.ranks} ranks "
                     f"busy, {flop_rate(c.compute.flops_alone)} alone ({c.compute.dtype}, n={c.compute.matmul_n})")
    if c.topology is not None:
        kinds = sorted({p.kind for p in c.topology.pairs})
        lines.append(f"topology: {len(c.topology.gpus)} GPUs, pairs over {', '.join(kinds)}"
                     + (", NVSwitch" if c.topology.nvswitch else ""))
    lines += [f"note: {n}" for n in (*c.notes, *cluster_conditions(c))]
    return lines


def cluster_fit_rows(c) -> list[list[str]]:
    rows = []
    for f in c.fits:
        sizes = f"{size(f.samples[0].size_bytes)}..{size(f.samples[-1].size_bytes)}" if f.samples else ""
        bw = fixed(1 / f.beta_s_per_byte, "GB/s", 3, show_unit=False) if f.beta_s_per_byte > 0 else "-"
        rows.append([f.op, f.scope, str(f.group_size), duration(f.alpha_s), bw, f"{f.r2:.3f}", sizes])
    return rows


MEMORY_COLUMNS = ["ranks", "stages", "params", "grads", "optimizer", "activations", "buffers", "overhead", "total", "fits"]
MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "buffers", "overhead", "total_bytes")


def rank_groups(memory_per_rank: Sequence[MemoryBreakdown]) -> list[tuple[str, MemoryBreakdown]]:
    """("3" or "0-1", breakdown) per group of ranks with identical memory (the dp replicas of a pipeline rank)."""
    groups: dict[tuple, list] = {}
    for m in memory_per_rank:
        key = (m.stages, m.parameters, m.gradients, m.optimizer_states, m.activations, m.buffers, m.overhead)
        groups.setdefault(key, []).append(m)
    return [(f"{ms[0].rank}" if len(ms) == 1 else f"{ms[0].rank}-{ms[-1].rank}", ms[0]) for ms in groups.values()]


def memory_rows(est) -> list[list[str]]:
    """One row per group of ranks with identical memory (all dp ranks of a pipeline stage are alike)."""
    rows = []
    for ranks, m in rank_groups(est.memory_per_rank):
        gib = [fixed(getattr(m, c), "GiB", 3, show_unit=False) for c in MEMORY_CATEGORIES]
        rows.append([ranks, ",".join(map(str, m.stages)), *gib, "yes" if m.total_bytes <= est.capacity_bytes else "NO"])
    return rows


def estimate_lines(strategy, est) -> list[str]:
    s, b = strategy, est.breakdown
    switches = s.tp_label[len(f"TP{s.tp}"):]   # '+SP', '+SP+shard', '+SP+async' ...
    shape = (f"dp={s.dp} x tp={s.tp}" + (f" ({switches})" if switches else "") + f" x pp={s.pp}"
             + (f" (v={s.v})" if s.v > 1 else "") + (f" x ep={s.ep}" if s.ep > 1 else "")
             + (f" x cp={s.cp}" if s.cp > 1 else "")
             + (", selective recompute" if s.selective else ""))
    # compute_s includes the exposed TP collectives and EP all-to-alls (the estimate adds them to each unit's
    # pass): shown apart
    tp_part = ", ".join(([f"tensor-parallel comm {duration(b.tp_comm_s)}"] if s.tp > 1 else [])
                        + ([f"expert-parallel all-to-alls {duration(b.ep_comm_s)}"] if s.ep > 1 else [])
                        + ([f"context-parallel key/value gathers {duration(b.cp_comm_s)}"] if s.cp > 1 else []))
    tp_part = f" (of which {tp_part})" if tp_part else ""
    lines = [f"strategy: {shape}, {s.zero_label}, {s.schedule}, {s.microbatches} micro-batches of {s.micro_batch_size}, "
             f"{s.precision}, {s.optimizer}",
             f"step time: {duration(est.step_time_s)} = compute {duration(b.compute_s)}{tp_part} + bubble "
             f"{duration(b.bubble_s)} + p2p {duration(b.p2p_s)} + data-parallel comm {duration(b.dp_comm_s)} + optimizer "
             f"{duration(b.optimizer_s)} ({est.compute_source} compute"
             + (f"; {est.calibrated_by}" if est.calibrated_by else "") + ")",
             f"bubble: {est.bubble_ratio:.3f} of ideal compute ((p-1)/m convention), {est.bubble_share:.1%} of rank-time idle",
             f"throughput: {est.tokens_per_s:,.0f} {est.throughput_unit}/s"
             + (f", MFU {est.mfu:.1%} (model FLOPs, PaLM convention)" if est.mfu is not None else "")
             + (f", HFU {est.hfu:.1%} (hardware FLOPs, with recompute)" if est.hfu is not None else ""),
             f"communication per step: p2p {size(est.comm.p2p_bytes_per_step)} ({est.comm.p2p_link}), "
             f"data-parallel {size(est.comm.dp_bytes_per_rank)} full-buffer per rank "
             f"({size(dp_wire_bytes(est.comm.dp_collectives, s.dp * s.cp))} on the wire; {est.comm.dp_link}: "
             + (", ".join(f"{k} {size(v)}" for k, v in est.comm.dp_collectives.items()) or "none") + ")"
             + (f", tied gradients {size(est.comm.tied_bytes_per_rank)} all-reduced across pipeline ranks"
                if est.comm.tied_bytes_per_rank else "")
             + (f", tensor-parallel {size(est.comm.tp_bytes_per_rank)} per rank ({est.comm.tp_link}: "
                + (", ".join(f"{k} {size(v)}" for k, v in est.comm.tp_collectives.items() if v) or "none") + ")"
                if s.tp > 1 else "")
             + (f", expert-parallel all-to-alls {size(est.comm.ep_bytes_per_rank)} per rank ({est.comm.ep_link})"
                if s.ep > 1 else "")
             + (f", context-parallel key/value all-gathers and reduce-scatters {size(est.comm.cp_bytes_per_rank)} "
                f"per rank ({est.comm.cp_link})" if s.cp > 1 else "")]
    for st in est.stages:
        lines.append(f"stage {st.stage}: {st.units[0]}..{st.units[-1]} ({len(st.units)} units, {st.params:,} params), "
                     f"F {duration(st.fwd_s)}, B {duration(st.bwd_s)} per micro-batch, "
                     f"{st.peak_in_flight} in flight x {size(st.activation_bytes)}")
    return lines


def estimate_json(strategy, est, device: str) -> dict:
    """`planner estimate --json`: the strategy and the estimate, with every figure the text prints that the record
    derives rather than stores: the data-parallel bytes on the wire (a ring's 2(N-1)/N of the full buffer), and the
    warning when the MFU is above the best published for the device (records.published; None otherwise)."""
    data = {"strategy": strategy.to_dict(), **est.to_dict()}
    data["comm"]["dp_wire_bytes_per_rank"] = dp_wire_bytes(est.comm.dp_collectives, strategy.dp * strategy.cp)
    data["implausible_mfu"] = implausible_mfu(est.mfu, device, strategy.precision)
    return data


def calibration_mismatch(profile: ModelProfile, cluster: ClusterProfile) -> str | None:
    """Why the cluster's calibration may not hold for this model: it was fitted on runs of other models (its
    factors carry their unit times' errors, not this model's). None where it has no runs or one of them is this
    model's."""
    cal = cluster.calibration
    models = sorted({r.model for r in cal.runs}) if cal is not None else []
    if not models or profile.name in models:
        return None
    return (f"the cluster's calibration was fitted on runs of {', '.join(models)}, not {profile.name}; its factors "
            "may not hold here (calibrate from this model's runs)")
