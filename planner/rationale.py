"""Why the plan won, in the terms of the ZeRO-or-pipeline question: which resource binds, with numbers."""
from __future__ import annotations

from cost_models.cluster import ClusterProfile
from cost_models.estimate import Estimate
from cost_models.strategy import Strategy
from cost_models.formatting import duration, fixed, size
from planner.plan import Rationale

# the rationale line of a model the executor cannot cut into stages (ModelProfile.pipeline_refusal says why)
NO_PIPELINES = "no pipeline strategies searched: the model cannot be pipelined"
COMM_BINDS = 0.15  # exposed communication above this share of the step makes bandwidth the binding resource


_COMPONENTS = (("compute_s", "compute"), ("bubble_s", "pipeline bubble"), ("p2p_s", "p2p transfers"),
               ("dp_comm_s", "data-parallel collectives"), ("optimizer_s", "optimizer step"))


def _own_binding(est: Estimate, cluster: ClusterProfile) -> tuple[str, str]:
    """What binds a strategy judged on its own breakdown: exposed communication past COMM_BINDS of the step, else
    computation."""
    b = est.breakdown
    comm_share = (b.dp_comm_s + b.p2p_s) / est.step_time_s if est.step_time_s else 0.0
    link = cluster.inter_node if est.comm.dp_link == "inter-node" and cluster.inter_node else cluster.intra_node
    if comm_share >= COMM_BINDS:
        return "bandwidth", (f"bandwidth binds: {comm_share:.0%} of the step is exposed communication "
                             f"({duration(b.dp_comm_s)} data-parallel over {link.kind}, {duration(b.p2p_s)} p2p)")
    return "compute", (f"compute binds: {b.compute_s / est.step_time_s:.0%} of the step is computation; bubble "
                       f"{duration(b.bubble_s)}, exposed communication {duration(b.dp_comm_s + b.p2p_s)}")


def _chosen_line(s: Strategy, est: Estimate) -> str:
    return (f"chosen: {s.summary}: {duration(est.step_time_s)} per step, {est.tokens_per_s:,.0f} "
            f"{est.throughput_unit}/s, peak {fixed(est.peak_memory_bytes, 'GiB', show_unit=False)} of "
            f"{fixed(est.capacity_bytes, 'GiB')}")


def by_hand(s: Strategy, est: Estimate, cluster: ClusterProfile) -> Rationale:
    """The rationale of a strategy chosen by hand (`planner estimate -o`): what binds it, with its numbers; no other
    strategy was compared."""
    binding, why = _own_binding(est, cluster)
    lines = (_chosen_line(s, est).replace("chosen:", "chosen by hand:", 1), why,
             "not compared with other strategies: `planner plan` searches them all")
    return Rationale(binding=binding, winner_family=s.family,
                     summary=f"chosen by hand: {s.summary} at {duration(est.step_time_s)} per step; {why}",
                     lines=lines, best_by_family={s.family: est.step_time_s})


def why_lost(s: Strategy, est: Estimate, ws: Strategy, west: Estimate) -> str:
    """The component that grew most against the winner, with both numbers."""
    if not est.fits:
        return f"does not fit: {fixed(est.peak_memory_bytes, 'GiB', 1)} > {fixed(est.capacity_bytes, 'GiB', 1)}"
    slower = est.step_time_s - west.step_time_s
    if slower <= 1e-9 * max(west.step_time_s, 1e-12):
        peaks = f"{fixed(est.peak_memory_bytes, 'GiB', show_unit=False)} vs {fixed(west.peak_memory_bytes, 'GiB')}"
        return f"ties on predicted time; ranked below for less memory headroom ({peaks} peak)"
    deltas = [(getattr(est.breakdown, f) - getattr(west.breakdown, f), f, label) for f, label in _COMPONENTS]
    delta, field, label = max(deltas)
    detail = f"{label} {duration(getattr(est.breakdown, field))} vs {duration(getattr(west.breakdown, field))}"
    if field == "bubble_s":
        detail += f" (bubble {est.bubble_ratio:.2f} of compute)"
    if field == "dp_comm_s":
        detail += f" ({size(est.comm.dp_bytes_per_rank)} per rank per step, {est.comm.dp_link})"
    return f"+{duration(slower)} per step; most of it {detail}"


def explain(ws: Strategy, west: Estimate, feasible, fastest_unfit, cluster: ClusterProfile,
            pruned_bounds: dict[str, float] | None = None, *, no_pipelines: str | None = None) -> Rationale:
    """Binding resource and the family comparison. `feasible` are costed candidates that fit (winner first).
    `no_pipelines`: why the model cannot be pipelined (only pp = 1 was searched), one line in place of the
    pipeline and hybrid families'."""
    best: dict[str, tuple[Strategy, Estimate]] = {}
    for c in feasible:
        fam = c.strategy.family
        if fam not in best or c.estimate.step_time_s < best[fam][1].step_time_s:
            best[fam] = (c.strategy, c.estimate)
    b = west.breakdown
    wf = ws.family
    others = [(e.step_time_s, s_, e) for fam, (s_, e) in best.items() if fam != wf]
    runner = min(others, key=lambda x: x[0], default=None)
    runner_comm = None
    if runner is not None:
        _, rs, re_ = runner
        deltas = {f: getattr(re_.breakdown, f) - getattr(b, f) for f, _ in _COMPONENTS}
        if max(deltas, key=deltas.get) in ("dp_comm_s", "p2p_s"):
            runner_comm = (rs, re_)
    if runner_comm is not None:
        # The question "ZeRO or pipeline?" was decided by the links: the best other family lost to communication.
        rs, re_ = runner_comm
        binding = "bandwidth"
        why = (f"bandwidth binds: the best {rs.family} strategy ({rs.summary}) spends "
               f"{duration(re_.breakdown.dp_comm_s + re_.breakdown.p2p_s)} per step in exposed communication "
               f"({size(re_.comm.dp_bytes_per_rank)} per rank over {re_.comm.dp_link} links) against "
               f"{duration(b.dp_comm_s + b.p2p_s)} here")
    elif fastest_unfit is not None and fastest_unfit.estimate.step_time_s < west.step_time_s:
        binding = "memory"
        fast = fastest_unfit.estimate
        why = (f"memory binds: the fastest strategy, {fastest_unfit.strategy.summary}, would take "
               f"{duration(fast.step_time_s)} but needs {fixed(fast.peak_memory_bytes, 'GiB', 1)} "
               f"per device against {fixed(cluster.device.memory_bytes, 'GiB', 1)}")
    else:
        binding, why = _own_binding(west, cluster)
    names = {"zero": "ZeRO (data parallel)", "pipeline": "pipeline", "hybrid": "pipeline x ZeRO hybrid"}
    lines = [_chosen_line(ws, west), why]
    if no_pipelines:
        lines.append(f"{NO_PIPELINES}: {no_pipelines}")
    for fam in ("zero", "pipeline", "hybrid"):
        if fam == wf or (no_pipelines and fam != "zero"):
            continue
        if fam in best:
            s, e = best[fam]
            lines.append(f"best {names[fam]}: {s.summary}: {duration(e.step_time_s)}; {why_lost(s, e, ws, west)}")
        elif pruned_bounds and fam in pruned_bounds:
            lines.append(f"best {names[fam]}: not costed: no such strategy can beat {duration(pruned_bounds[fam])} (its compute "
                         f"alone, a lower bound), slower than the top candidates")
        else:
            lines.append(f"no {names[fam]} strategy fits or divides the batch on these devices")
    summary = f"{names[wf]} wins: {ws.summary} at {duration(west.step_time_s)} per step; {why}"
    return Rationale(binding=binding, winner_family=wf, summary=summary, lines=tuple(lines),
                     best_by_family={f: e.step_time_s for f, (_, e) in best.items()})
