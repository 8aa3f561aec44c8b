"""Why the plan won, in the terms of the ZeRO-or-pipeline question: which resource binds, with numbers."""
from __future__ import annotations

from typing import Mapping, cast

from cost_models.cost.comm import dp_wire_bytes
from cost_models.cost.estimate import Estimate
from cost_models.records.cluster import ClusterProfile
from cost_models.records.formatting import duration, fixed, size
from cost_models.records.strategy import Strategy, family_of
from planner.plan import Binding, Rationale, WinnerFamily
from planner.space import TPOptions

# the rationale line of a model the executor cannot cut into stages (ModelProfile.pipeline_refusal says why)
NO_PIPELINES = "no pipeline strategies searched: the model cannot be pipelined"
# the rationale line of a model with no tensor-parallel plan (TPShape.refusal says why)
NO_TP = "no tensor-parallel strategies searched"
COMM_BINDS = 0.15  # exposed communication above this share of the step makes bandwidth the binding resource


_COMPONENTS = (("compute_s", "compute"), ("bubble_s", "pipeline bubble"), ("p2p_s", "p2p transfers"),
               ("dp_comm_s", "data-parallel collectives"), ("tp_comm_s", "tensor-parallel collectives"),
               ("ep_comm_s", "expert-parallel all-to-alls"), ("cp_comm_s", "context-parallel key/value gathers"),
               ("optimizer_s", "optimizer step"))


def _part(est: Estimate, field: str) -> float:
    """A step-time component. The estimate counts the exposed TP collectives, EP all-to-alls and CP gathers inside
    compute_s (StepBreakdown); here compute is without them."""
    b = est.breakdown
    value = getattr(b, field)
    return value - b.tp_comm_s - b.ep_comm_s - b.cp_comm_s if field == "compute_s" else value


def tp_traffic(est: Estimate) -> tuple[float, str, dict[str, float]]:
    """(bytes per rank per step, link, op -> bytes) of the tensor-parallel collectives; (0, "", {}) without tp."""
    comm = est.comm
    return comm.tp_bytes_per_rank, "" if comm.tp_link == "none" else comm.tp_link, dict(comm.tp_collectives)


def _dp_bytes(est: Estimate, dp: int) -> str:
    """Data-parallel bytes per rank per step, both conventions named: the full buffers (as the executor's CommCounter
    counts them; CommVolume.dp_bytes_per_rank) and what goes on the wire with ring collectives (comm.dp_wire_bytes)."""
    wire = dp_wire_bytes(est.comm.dp_collectives, dp)
    return f"{size(est.comm.dp_bytes_per_rank)} full-buffer, {size(wire)} on the wire"


def _states(est: Estimate) -> tuple[int, int]:
    """(model-state bytes, activation bytes) of the fullest rank."""
    m = max(est.memory_per_rank, key=lambda x: x.total_bytes)
    return m.parameters + m.gradients + m.optimizer_states, m.activations


def _own_binding(est: Estimate, cluster: ClusterProfile) -> tuple[Binding, str]:
    """What binds a strategy judged on its own breakdown: exposed communication past COMM_BINDS of the step, else
    computation."""
    b = est.breakdown
    comm = _comm_s(est)
    comm_share = comm / est.step_time_s if est.step_time_s else 0.0
    link = cluster.inter_node if est.comm.dp_link == "inter-node" and cluster.inter_node else cluster.intra_node
    if comm_share >= COMM_BINDS:
        return "bandwidth", (f"bandwidth binds: {comm_share:.0%} of the step is exposed communication "
                             f"({duration(b.dp_comm_s)} data-parallel over {link.kind}, {duration(b.p2p_s)} p2p"
                             + (f", {duration(_part(est, 'tp_comm_s'))} tensor-parallel" if _part(est, "tp_comm_s")
                                else "")
                             + (f", {duration(b.ep_comm_s)} expert all-to-alls" if b.ep_comm_s else "") + ")")
    return "compute", (f"compute binds: {_part(est, 'compute_s') / est.step_time_s:.0%} of the step is computation; bubble "
                       f"{duration(b.bubble_s)}, exposed communication {duration(comm)}")


def _chosen_line(s: Strategy, est: Estimate) -> str:
    return (f"chosen: {s.summary}: {duration(est.step_time_s)} per step, {est.tokens_per_s:,.0f} "
            f"{est.throughput_unit}/s, peak {fixed(est.peak_memory_bytes, 'GiB', show_unit=False)} of "
            f"{fixed(est.capacity_bytes, 'GiB')}")


def by_hand(s: Strategy, est: Estimate, cluster: ClusterProfile, *, at_tp1: Estimate | None = None) -> Rationale:
    """The rationale of a strategy chosen by hand (`planner estimate -o`): what binds it, with its numbers; no other
    strategy was compared. at_tp1: the same strategy at tp = 1 (what tensor parallelism saves in memory)."""
    binding, why = _own_binding(est, cluster)
    lines: tuple[str, ...] = (_chosen_line(s, est).replace("chosen:", "chosen by hand:", 1), why,
                              "not compared with other strategies: `planner plan` searches them all")
    if s.tp > 1:
        lines += (_tp_chosen_line(s, est, cluster, at_tp1),)
    if s.ep > 1:
        lines += (f"expert parallelism: routed experts split {s.ep} ways, all-to-alls "
                  f"{size(est.comm.ep_bytes_per_rank)} per rank per step over {est.comm.ep_link} links, "
                  f"{duration(est.breakdown.ep_comm_s)} exposed",)
    # Strategy.family is typed str; family_of only ever returns one of WinnerFamily's values
    return Rationale(binding=binding, winner_family=cast(WinnerFamily, s.family),
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
    deltas = [(_part(est, f) - _part(west, f), f, label) for f, label in _COMPONENTS]
    delta, field, label = max(deltas)
    detail = f"{label} {duration(_part(est, field))} vs {duration(_part(west, field))}"
    if field == "bubble_s":
        detail += f" (bubble {est.bubble_ratio:.2f} of compute)"
    if field == "dp_comm_s":
        detail += f" ({_dp_bytes(est, s.dp * s.cp)} per rank per step, {est.comm.dp_link})"
    if field == "tp_comm_s":
        tp_bytes, tp_link, _ = tp_traffic(est)
        detail += f" ({size(tp_bytes)} per rank per step" + (f", {tp_link})" if tp_link else ")")
    if field == "ep_comm_s":
        detail += f" ({size(est.comm.ep_bytes_per_rank)} per rank per step, {est.comm.ep_link})"
    return f"+{duration(slower)} per step; most of it {detail}"


def _best_by(feasible, key) -> dict:
    """key(strategy) -> (strategy, estimate) of the fastest feasible candidate with that key."""
    best: dict = {}
    for c in feasible:
        k = key(c.strategy)
        if k not in best or c.estimate.step_time_s < best[k][1].step_time_s:
            best[k] = (c.strategy, c.estimate)
    return best


def _base_family(s: Strategy) -> str:
    """The ZeRO-or-pipeline question's family, whatever the tensor parallelism."""
    return family_of(dp=s.dp, pp=s.pp)


def _comm_s(est: Estimate) -> float:
    return (est.breakdown.dp_comm_s + est.breakdown.p2p_s + _part(est, "tp_comm_s") + _part(est, "ep_comm_s")
            + _part(est, "cp_comm_s"))


def _binding(ws: Strategy, west: Estimate, best: dict, fastest_unfit, cluster: ClusterProfile) -> tuple[Binding, str]:
    """(binding resource, the line saying why), judged against the best strategy of every other family."""
    others = [(e.step_time_s, s_, e) for fam, (s_, e) in best.items() if fam != ws.family]
    runner = min(others, key=lambda x: x[0], default=None)
    if runner is not None:
        _, rs, re_ = runner
        deltas = {f: _part(re_, f) - _part(west, f) for f, _ in _COMPONENTS}
        if max(deltas, key=deltas.__getitem__) in ("dp_comm_s", "p2p_s", "tp_comm_s", "ep_comm_s", "cp_comm_s"):
            # The question was decided by the links: the best other family lost to communication.
            tp_bytes, tp_link, _ = tp_traffic(re_)
            tp_part = f", {size(tp_bytes)} tensor-parallel over {tp_link or 'intra-node'}" if tp_bytes else ""
            return "bandwidth", (f"bandwidth binds: the best {rs.family} strategy ({rs.summary}) spends "
                                 f"{duration(_comm_s(re_))} per step in exposed communication "
                                 f"({_dp_bytes(re_, rs.dp * rs.cp)} per rank over {re_.comm.dp_link} links"
                                 f"{tp_part}) against {duration(_comm_s(west))} here")
    if fastest_unfit is not None and fastest_unfit.estimate.step_time_s < west.step_time_s:
        fast = fastest_unfit.estimate
        return "memory", (f"memory binds: the fastest strategy, {fastest_unfit.strategy.summary}, would take "
                          f"{duration(fast.step_time_s)} but needs {fixed(fast.peak_memory_bytes, 'GiB', 1)} "
                          f"per device against {fixed(cluster.device.memory_bytes, 'GiB', 1)}")
    return _own_binding(west, cluster)


FAMILY_NAMES = {"zero": "ZeRO (data parallel)", "pipeline": "pipeline", "hybrid": "pipeline x ZeRO hybrid"}


def explain(ws: Strategy, west: Estimate, feasible, fastest_unfit, cluster: ClusterProfile,
            pruned_bounds: dict[str, float] | None = None, *, no_pipelines: str | None = None) -> Rationale:
    """Binding resource and the family comparison. `feasible` are costed candidates that fit (winner first).
    `no_pipelines`: why the model cannot be pipelined (only pp = 1 was searched), one line in place of the
    pipeline and hybrid families'. The ZeRO / pipeline / hybrid lines compare each family's best at any tp
    (tp_lines explains the tensor-parallel degree); best_by_family keys the families with tp apart."""
    best = _best_by(feasible, lambda s_: s_.family)
    by_base = _best_by(feasible, _base_family)
    pruned_base: dict[str, float] = {}
    for fam, bound in (pruned_bounds or {}).items():   # "hybrid+tp" -> "hybrid", "tensor" -> "zero"
        base = "zero" if fam == "tensor" else fam.removesuffix("+tp")
        pruned_base[base] = min(bound, pruned_base.get(base, bound))
    binding, why = _binding(ws, west, best, fastest_unfit, cluster)
    wf = _base_family(ws)
    lines = [_chosen_line(ws, west), why]
    if no_pipelines:
        lines.append(f"{NO_PIPELINES}: {no_pipelines}")
    for fam in ("zero", "pipeline", "hybrid"):
        if fam == wf or (no_pipelines and fam != "zero"):
            continue
        if fam in by_base:
            s, e = by_base[fam]
            lines.append(f"best {FAMILY_NAMES[fam]}: {s.summary}: {duration(e.step_time_s)}; "
                         f"{why_lost(s, e, ws, west)}")
        elif fam in pruned_base:
            lines.append(f"best {FAMILY_NAMES[fam]}: not costed: no such strategy can beat "
                         f"{duration(pruned_base[fam])} (its compute alone, a lower bound), slower than the top "
                         f"candidates")
        else:
            lines.append(f"no {FAMILY_NAMES[fam]} strategy fits or divides the batch on these devices")
    name = FAMILY_NAMES[wf] + (f" with {ws.tp}-way tensor parallelism" if ws.tp > 1 else "")
    summary = f"{name} wins: {ws.summary} at {duration(west.step_time_s)} per step; {why}"
    return Rationale(binding=binding, winner_family=cast(WinnerFamily, ws.family), summary=summary, lines=tuple(lines),
                     best_by_family={f: e.step_time_s for f, (_, e) in best.items()})


def _tp_chosen_line(ws: Strategy, west: Estimate, cluster: ClusterProfile, at_tp1: Estimate | None) -> str:
    """What the chosen tensor parallelism moves (per rank per step, on which link) and what it saves in memory."""
    tp_bytes, tp_link, ops = tp_traffic(west)
    link = f"{tp_link or 'intra-node'} ({cluster.intra_node.kind}) links"
    line = (f"tensor parallelism: {ws.tp}-way{' with sequence parallelism' if ws.sp else ''} inside each node: "
            + (", ".join(f"{op.replace('_', ' ')} {size(v)}" for op, v in ops.items()) + " = " if len(ops) > 1 else "")
            + f"{size(tp_bytes)} per rank per step over {link}, {duration(_part(west, 'tp_comm_s'))} exposed")
    if at_tp1 is not None:
        states, acts = _states(west)
        states1, acts1 = _states(at_tp1)
        line += (f"; it saves {fixed(states1 + acts1 - states - acts, 'GiB', 1)} per rank against tp=1 with the same "
                 f"dp, pp, ZeRO and micro-batches (model states {fixed(states, 'GiB', 1)} vs "
                 f"{fixed(states1, 'GiB', 1)}, activations {fixed(acts, 'GiB', 1)} vs {fixed(acts1, 'GiB', 1)})")
    return line


def tp_lines(ws: Strategy, west: Estimate, feasible, cluster: ClusterProfile, options: TPOptions, *,
             pruned_tp_bounds: Mapping[int, float] | None = None, at_tp1: Estimate | None = None) -> list[str]:
    """Why this tensor-parallel degree: what it moves and saves, and the best strategy of every other degree
    searched, in numbers from their estimates. at_tp1: the winner's estimate with tp = 1 (memory it saves)."""
    if options.refusal:
        return [f"{NO_TP}: {options.refusal}"]
    lines = list(options.notes)
    if ws.tp > 1:
        lines.append(_tp_chosen_line(ws, west, cluster, at_tp1))
    degrees = sorted({tp for tp, _ in options.pairs})
    if len(degrees) == 1:
        return lines
    return lines + _other_degrees("tp", "tensor parallelism", degrees, ws, west, feasible, pruned_tp_bounds)


def _other_degrees(key: str, what: str, degrees, ws: Strategy, west: Estimate, feasible,
                   pruned: Mapping[int, float] | None = None) -> list[str]:
    """For the degrees of `key` ("tp", "ep" or "cp") searched: that none was chosen (where the winner has 1), and the best
    strategy of every other degree with why it lost, or that it was pruned by a bound or nothing of it fits."""
    chosen = getattr(ws, key)
    lines = []
    if chosen == 1:
        lines.append(f"no {what} chosen: every searched {key} ({', '.join(map(str, degrees[1:]))}) is slower or does "
                     f"not fit (below)")
    best = _best_by(feasible, lambda s_: getattr(s_, key))
    for d in degrees:
        if d == chosen:
            continue
        if d in best:
            s, e = best[d]
            lines.append(f"best {key}={d}: {s.summary}: {duration(e.step_time_s)}; {why_lost(s, e, ws, west)}")
        elif pruned and d in pruned:
            lines.append(f"best {key}={d}: not costed: no such strategy can beat {duration(pruned[d])} (a "
                         f"lower bound), slower than the top candidates")
        else:
            lines.append(f"{key}={d}: no strategy fits or divides the batch on these devices")
    return lines


def ep_lines(ws: Strategy, west: Estimate, feasible, *, experts: int, degrees: tuple[int, ...],
             at_ep1: Estimate | None = None, pruned: Mapping[int, float] | None = None, load: str = "") -> list[str]:
    """Why this expert-parallel degree (MoE models): what its all-to-alls move and cost, the routing load it is
    priced at (`load`: cost.moe.imbalance_source), what it saves against ep = 1 (at_ep1: the winner's strategy
    with ep = 1, all else equal), and the best strategy of every other degree searched, from their estimates. []
    for a dense model."""
    if not experts:
        return []
    line = None
    if ws.ep > 1:
        b = west.breakdown
        line = (f"expert parallelism: each block's {experts} routed experts split {ws.ep} ways "
                f"({experts // ws.ep} per rank), all-to-alls {size(west.comm.ep_bytes_per_rank)} per rank per step "
                f"over {west.comm.ep_link} links, {duration(b.ep_comm_s)} exposed" + (f"; {load}" if load else ""))
        if at_ep1 is not None:   # ZeRO-2/3 shard the experts' states as much without EP; the gathered ones and
            # the data-parallel traffic are what shrink
            states, _ = _states(west)
            states1, _ = _states(at_ep1)
            line += (f"; peak {fixed(west.peak_memory_bytes, 'GiB', 1)} vs {fixed(at_ep1.peak_memory_bytes, 'GiB', 1)} "
                     f"at ep=1 with the same dp, pp, ZeRO and micro-batches" + ("" if at_ep1.fits else " (no fit)")
                     + f" (model states {fixed(states, 'GiB', 1)} vs {fixed(states1, 'GiB', 1)}), data-parallel "
                     f"{duration(b.dp_comm_s)} vs {duration(at_ep1.breakdown.dp_comm_s)}")
    return _and_others(line, "ep", "expert parallelism", degrees, ws, west, feasible, pruned)


def _and_others(line: str | None, key: str, what: str, degrees, ws: Strategy, west: Estimate, feasible,
                pruned: Mapping[int, float] | None) -> list[str]:
    """`line` (the chosen degree's, where it has one), then the other degrees searched (_other_degrees)."""
    return ([line] if line else []) + (_other_degrees(key, what, degrees, ws, west, feasible, pruned)
                                       if len(degrees) > 1 else [])


def cp_lines(ws: Strategy, west: Estimate, feasible, *, seq_len: int, degrees: tuple[int, ...],
             at_cp1: Estimate | None = None, pruned: Mapping[int, float] | None = None) -> list[str]:
    """Why this context-parallel degree (long sequences): what its key/value gathers move and cost, what it saves
    against cp = 1 (at_cp1: the winner's strategy with cp = 1, all else equal: whole sequences on fewer devices),
    and the best strategy of every other degree searched. [] where only cp = 1 was searched."""
    line = None
    if ws.cp > 1:
        b = west.breakdown
        line = (f"context parallelism: each {seq_len:,}-token sequence split {ws.cp} ways ({seq_len // ws.cp:,} "
                f"tokens per rank), key/value all-gathers and reduce-scatters {size(west.comm.cp_bytes_per_rank)} "
                f"per rank per step over {west.comm.cp_link} links, {duration(b.cp_comm_s)} exposed")
        if at_cp1 is not None:
            act = max(m.activations for m in west.memory_per_rank)
            act1 = max(m.activations for m in at_cp1.memory_per_rank)
            line += (f"; activations {fixed(act, 'GiB', 1)} vs {fixed(act1, 'GiB', 1)} per rank at cp=1 with the "
                     f"same dp, pp, tp and micro-batches (peak {fixed(west.peak_memory_bytes, 'GiB', 1)} vs "
                     f"{fixed(at_cp1.peak_memory_bytes, 'GiB', 1)}" + ("" if at_cp1.fits else ": no fit") + ")")
    return _and_others(line, "cp", "context parallelism", degrees, ws, west, feasible, pruned)
