"""Plan reports: the same content as Markdown and as one self-contained HTML page with inline SVG pictures.

Sections: summary; why, with numbers (the binding resource, bubble, communication per link kind, why the others
lost); the pipeline timeline (re-simulated from the plan's own action order and stage times); per-rank memory
against capacity; every costed candidate as step time against peak memory; the alternatives; the mapping's
approximations; the candidates `planner plan --verify` ran, if any; and, given a run, predicted against measured.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

from cost_models.cost.compute import executed_dtype
from cost_models.cost.estimate import StageEstimate
from cost_models.cost.sharing import send_delay
from cost_models.cost.simulator import simulate
from cost_models.records.formatting import GIB, duration, fixed, load_line, measured, size
from cost_models.records.precision import DTYPE_BYTES
from cost_models.records.published import implausible_mfu
from cost_models.records.schedule import SCHEDULES, parse_order
from planner.plan import VERIFY_TIE_REL, Plan
from planner.rationale import tp_traffic
from planner.run_record import RunFile
from planner.summaries import cluster_conditions, rank_groups

KIND_COLOR = {"F": "#4e79a7", "B": "#59a14f", "I": "#f28e2b", "W": "#b07aa1"}
MEMORY_COLOR = {"parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer_states": "#e15759",
                "activations": "#76b7b2", "buffers": "#edc948", "overhead": "#bab0ac"}
MAX_TIMELINE_EVENTS = 20_000
APPROXIMATIONS = (
    "ZeRO-2 and ZeRO-3 run on FSDP2, which keeps parameters sharded at rest in both; ZeRO-2 "
    "(reshard_after_forward=False) holds the gathered parameters from forward to backward, counted as buffers. "
    "DeepSpeed's ZeRO-2 keeps them replicated instead: the same bytes under another label.",
    "In a pipeline each stage is one FSDP unit and torch's stage defers gradient sync to the end of the step, so "
    "ZeRO-2/3 stages hold unsharded parameters and gradients of the whole stage while micro-batches run, and their "
    "collectives are not overlapped with compute.",
    "DDP runs with gradient_as_bucket_view (no second gradient copy); pipelined ZeRO-0/1 all-reduce gradients "
    "after the schedule, because DDP-wrapped stages fail or give wrong gradients under GPipe and interleaving.",
    "Backward splits into input and weight gradients in equal halves where the schedule splits it ("
    + ", ".join(name for name, spec in SCHEDULES.items() if spec.split_backward) + ").",
    "Measured unit times (CPU profiles) are scaled to other micro-batch sizes through two timings and slowed by "
    "core sharing from the compute probe; FLOP-based times use the device's dense peak x matmul efficiency.",
)


@dataclass
class Section:
    title: str
    lines: list[str] = field(default_factory=list)
    tables: list[tuple[list[str], list[list[str]]]] = field(default_factory=list)
    svg: str = ""


def sections(plan: Plan, run: RunFile | None = None) -> list[Section]:
    out = [_summary(plan), _why(plan), _timeline(plan), _memory(plan), _candidates(plan), _alternatives(plan),
           Section("How the plan maps to torch (approximations)", list(APPROXIMATIONS))]
    if plan.trials:
        out.append(_verified(plan))
    if run is not None:
        out.append(_measured(run))
    return out


def _summary(plan: Plan) -> Section:
    est = plan.prediction
    peak = max(m.total_bytes for m in est.memory_per_rank)
    low = min(m.total_bytes for m in est.memory_per_rank)
    return Section("Summary", [
        f"Chosen: {plan.strategy.summary} on {plan.gpus} x {plan.cluster.device.name} ({plan.cluster.name}), global "
        f"batch {plan.global_batch_size} sequences of {plan.model.seq_len} tokens.",
        f"Predicted step time {duration(est.step_time_s)}; throughput {est.tokens_per_s:,.0f} {est.throughput_unit}/s"
        + (f"; MFU {est.mfu:.1%} (model FLOPs, PaLM convention: no recompute)"
           + (f", HFU {est.hfu:.1%} (hardware FLOPs: with recompute and torch's attention backward)"
              if est.hfu is not None else "")
           if est.mfu is not None else "; MFU/HFU not given (no datasheet peak for this device)")
        + ".",
        f"Peak memory per rank {fixed(peak, 'GiB')} (lowest {fixed(low, 'GiB')}) of {fixed(est.capacity_bytes, 'GiB')} "
        f"capacity: {'fits' if est.fits else 'DOES NOT FIT'}.",
        *(f"Warning: {w}." for w in [implausible_mfu(est.mfu, plan.cluster.device.name, plan.strategy.precision)]
          if w),
        *(f"Profile: {line}." for line in plan.provenance.profile_conditions),
        *(f"Cluster: {line}." for line in cluster_conditions(plan.cluster)),
    ])


def _why(plan: Plan) -> Section:
    est, r, b = plan.prediction, plan.rationale, plan.prediction.breakdown
    comm_lines = [f"Pipeline point-to-point: {size(est.comm.p2p_bytes_per_step)} per step ({est.comm.p2p_link})."
                  if plan.strategy.n_stages > 1 else "Pipeline point-to-point: none (one stage)."]
    if est.comm.dp_collectives:
        comm_lines.append("Data-parallel collectives (" + est.comm.dp_link + "): " + ", ".join(
            f"{op.replace('_', ' ')} {size(v)}" for op, v in est.comm.dp_collectives.items())
                          + f" per rank per step, {duration(b.dp_comm_s)} exposed.")
    else:
        comm_lines.append("Data-parallel collectives: none (dp = 1).")
    if est.comm.tied_bytes_per_rank:
        comm_lines.append(f"Tied gradients (a parameter shared by stages on different pipeline ranks): all-reduced "
                          f"across those ranks after the data-parallel syncs, {size(est.comm.tied_bytes_per_rank)} "
                          "per step on rank 0; with its wait for the peer it is in the exposed time "
                          f"({duration(b.dp_comm_s)}).")
    comm_lines.append(_tp_comm_line(plan))
    s = plan.strategy
    for on, line in ((s.ep > 1, f"Expert-parallel all-to-alls ({est.comm.ep_link}, groups of {s.ep}): "
                                f"{size(est.comm.ep_bytes_per_rank)} per rank per step, {duration(b.ep_comm_s)} "
                                f"exposed."),
                     (s.cp > 1, f"Context-parallel key/value all-gathers and reduce-scatters ({est.comm.cp_link}, "
                                f"groups of {s.cp}): {size(est.comm.cp_bytes_per_rank)} per rank per step, "
                                f"{duration(b.cp_comm_s)} exposed.")):
        if on:
            comm_lines.append(line)
    # compute_s holds the exposed TP, EP and CP collectives (each unit's pass): shown apart
    tp_s, ep_s, cp_s = b.tp_comm_s, b.ep_comm_s, b.cp_comm_s
    return Section("Why: ZeRO or pipeline?", [
        r.summary,
        f"Step time = compute {duration(b.compute_s - tp_s - ep_s - cp_s)} + bubble {duration(b.bubble_s)} + p2p "
        f"{duration(b.p2p_s)} + data-parallel communication {duration(b.dp_comm_s)}"
        + (f" + tensor-parallel communication {duration(tp_s)}" if s.tp > 1 else "")
        + (f" + expert-parallel all-to-alls {duration(ep_s)}" if s.ep > 1 else "")
        + (f" + context-parallel key/value gathers {duration(cp_s)}" if s.cp > 1 else "")
        + f" + optimizer {duration(b.optimizer_s)}.",
        f"Bubble: {est.bubble_ratio:.3f} of ideal compute (Narayanan's (p-1)/m convention), "
        f"{est.bubble_share:.1%} of rank-time idle.",
        *comm_lines, *r.lines[2:]])


def _tp_comm_line(plan: Plan) -> str:
    """Tensor-parallel traffic per rank per step and its link (Megatron's all-reduces; all-gather and
    reduce-scatter under sequence parallelism)."""
    s, est = plan.strategy, plan.prediction
    if s.tp == 1:
        return "Tensor-parallel collectives: none (tp = 1)."
    tp_bytes, link, ops = tp_traffic(est)
    per_op = ", ".join(f"{op.replace('_', ' ')} {size(v)}" for op, v in ops.items()) or size(tp_bytes)
    exposed = est.breakdown.tp_comm_s
    return (f"Tensor-parallel collectives ({link or 'intra-node'}, {plan.cluster.intra_node.kind}, groups of {s.tp} "
            f"adjacent ranks inside a node{', sequence parallel' if s.sp else ''}): {per_op} per rank per step, "
            f"{duration(exposed)} exposed.")


def mesh_cell(s) -> str:
    """'pp x dp x tp' of a strategy, for tables: '4 x 32 x 8', and its cp where it has one: '1 x 2 x 4 x cp4'."""
    return f"{s.pp} x {s.dp} x {s.tp}" + (" +SP" if s.sp else "") + (f" x cp{s.cp}" if s.cp > 1 else "")


def _timeline(plan: Plan) -> Section:
    s = plan.strategy
    spec = s.spec
    timeline = Section("Pipeline timeline", [
        f"Ranks (rows) against time: forward (F), backward (B), input-gradient (I) and weight-gradient (W) blocks, "
        f"numbered by micro-batch; gaps are bubbles. {s.schedule}, {s.microbatches} micro-batches"
        + (f", {s.v} chunks per rank" if s.v > 1 else "") + "."
        + (f" {s.schedule}: {spec.summary}." if s.n_stages > 1 else "")
        + (" The darker end of a block is its expert-parallel all-to-alls." if s.ep > 1 else "")],
        svg=timeline_svg(plan))
    stage_rows = [[str(st.stage), f"{st.units[0]} .. {st.units[-1]} ({len(st.units)})", f"{st.params:,}",
                   duration(st.fwd_s), duration(st.bwd_s), str(st.peak_in_flight),
                   fixed(st.activation_bytes, "MiB", show_unit=False)] for st in plan.prediction.stages]
    timeline.tables.append((["stage", "units", "params", "F / micro-batch", "B / micro-batch", "in flight",
                             "activations MiB / micro-batch"], stage_rows))
    return timeline


def _memory(plan: Plan) -> Section:
    capacity = fixed(plan.prediction.capacity_bytes, "GiB")
    memory = Section("Memory per rank", [f"Stacked by category against the {capacity} capacity (dashed line). "
                                         "GiB = 2^30 bytes."], svg=memory_svg(plan))
    note = _dtype_note(plan)
    if note:
        memory.lines.append(note)
    memory.tables.append((["ranks", "parameters", "gradients", "optimizer", "activations", "buffers", "overhead",
                           "total GiB"], [[label] + [_gib(getattr(m, c), 3) for c in (*MEMORY_COLOR, "total_bytes")]
                                          for label, m in _rank_groups(plan)]))
    return memory


def _dtype_note(plan: Plan) -> str:
    """Where activations come from a profile in another dtype than the run computes in: how they were scaled."""
    run = executed_dtype(plan.strategy.precision, plan.cluster.device.kind)
    # "" in plans written before the dtype was recorded; the same element size: nothing was scaled
    if DTYPE_BYTES.get(plan.model.dtype, DTYPE_BYTES[run]) == DTYPE_BYTES[run]:
        return ""
    article = "an" if plan.model.dtype.startswith("f") else "a"
    line = f"Activations are scaled from {article} {plan.model.dtype} profile to {run} (memory.saved_at)"
    other = plan.model.saved_other_dtype_bytes
    line += (f": the {size(other)} its units save in other dtypes per profiled micro-batch (token ids, masks, "
             f"statistics) keep their size." if other else ".")
    if DTYPE_BYTES[run] < DTYPE_BYTES[plan.model.dtype]:
        # measured on meta, 2 x 64 tokens: bf16 saved bytes over half the fp32 profile's, gpt2-small 1.25x, llama-tiny
        # 1.27x (the math attention's fp32 probabilities and the norms' statistics stay fp32 in bf16)
        line += (f" What a {run} run keeps in fp32 {article} {plan.model.dtype} profile cannot tell (measured on "
                 f"meta: gpt2-small saves 25% more activation bytes than predicted this way, llama-tiny 27%): "
                 f"profile with --dtype {run} for exact activations.")
    return line


def _candidates(plan: Plan) -> Section:
    pv = plan.provenance
    return Section("Candidates", [f"{len(plan.candidates)} costed strategies, predicted step time against peak "
                                  "memory per rank; filled: fits, crossed: does not fit; the chosen one is ringed. "
                                  f"Search: {pv.points_considered} points, {pv.points_pruned} pruned, "
                                  f"{pv.points_costed} estimates in {duration(pv.planning_time_s)}."],
                   svg=candidates_svg(plan))


def _alternatives(plan: Plan) -> Section:
    est = plan.prediction
    rows = [[plan.strategy.name, mesh_cell(plan.strategy), duration(est.step_time_s), _gib(est.peak_memory_bytes),
             "chosen"]]
    rows += [[a.strategy.name, mesh_cell(a.strategy), duration(a.step_time_s), _gib(a.peak_memory_bytes),
              a.lost_because] for a in plan.alternatives]
    return Section("Alternatives", [], tables=[(["strategy", "pp x dp x tp", "step time", "peak GiB", "why it lost"],
                                                rows)])


TRIAL_COLUMNS = ["candidate", "predicted", "measured", "measured / predicted", "verdict"]


def trial_rows(plan: Plan) -> list[list[str]]:
    """`planner plan --verify K`'s trials, predicted order (the report and the CLI print the same rows)."""
    chosen = next((t for t in plan.trials if t.strategy == plan.strategy.name), None)
    rows = []
    for t in plan.trials:
        if t.strategy == plan.strategy.name:
            verdict = "chosen"
        elif t.measured_s is None:
            verdict = (t.failure or "") if (t.failure or "").startswith("not run") else f"failed: {t.failure}"
        elif chosen is not None and chosen.measured_s is not None and t.measured_s < chosen.measured_s:
            verdict = f"as fast within {VERIFY_TIE_REL:.0%}; ranked lower by prediction"
        else:
            verdict = "slower"
        rows.append([t.strategy, duration(t.predicted_s), "-" if t.measured_s is None else duration(t.measured_s),
                     "-" if t.ratio is None else f"{t.ratio:.2f}", verdict])
    return rows


def _verified(plan: Plan) -> Section:
    steps = max(t.steps for t in plan.trials)
    first = plan.trials[0].strategy   # the predicted best
    return Section("Verified", [
        f"planner plan --verify ran {len(plan.trials)} candidate(s) on the planning machine in predicted order, "
        f"{steps} timed steps each after a warm-up; measured: the median step time of the slowest rank. "
        + (f"Chosen by measurement: {plan.strategy.name} in place of the predicted best, {first} (why above)."
           if first != plan.strategy.name else f"The predicted best was kept: no other candidate ran more than "
           f"{VERIFY_TIE_REL:.0%} faster.")],
        tables=[(TRIAL_COLUMNS, trial_rows(plan))])


MEASURE_COLUMNS = ["quantity", "predicted", "measured", "error"]


def measure_rows(run: RunFile) -> list[list[str]]:
    """The run's predicted-vs-measured table (the report and `planner run` print the same rows)."""
    return [[m.quantity, measured(m.predicted, m.unit), measured(m.measured, m.unit),
             "-" if m.error_pct is None else f"{m.error_pct:+.1f}%"] for m in run.measures]


def _measured(run: RunFile) -> Section:
    return Section("Predicted vs measured", [
        f"Run: {run.steps} steps ({run.warmup} warm-up) on {run.world_size} ranks ({run.backend}); measured median "
        f"step {duration(run.step_time_s['median_s'])} against {duration(run.predicted_step_time_s)} predicted; "
        f"losses " + ", ".join(f"{x:.4f}" for x in run.losses) + ".",
        *([load_line(run.load_1min, run.cpus, run.world_size) + "."] if run.load_1min and run.cpus else [])],
        tables=[(MEASURE_COLUMNS, measure_rows(run))])


def _gib(n_bytes: float, decimals: int = 2) -> str:
    return fixed(n_bytes, "GiB", decimals, show_unit=False)


def _rank_groups(plan: Plan):
    """(label, breakdown) per group of ranks with identical memory (the dp replicas of a pipeline rank)."""
    return [(f"rank {ranks}" if "-" not in ranks else f"ranks {ranks}", m)
            for ranks, m in rank_groups(plan.prediction.memory_per_rank)]


def timeline_svg(plan: Plan, width: int = 960) -> str:
    est = plan.prediction
    order = parse_order(est.pipeline_order)
    sim = simulate(order, [st.cost() for st in est.stages], keep_timeline=True,
                   send_delay_s=send_delay(plan.strategy, plan.cluster))   # as the estimate simulated it
    events = sim.timeline
    span = sim.makespan_s or 1.0
    row, left, top = 28, 70, 20
    height = top + row * len(order) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="pipeline timeline">']
    scale = (width - left - 10) / span
    for r in sorted(order):
        y = top + r * row
        parts.append(f'<rect class="lane" x="{left}" y="{y}" width="{width - left - 10}" height="{row - 6}" fill="#eee"/>')
        parts.append(f'<text x="4" y="{y + row / 2}" font-size="12">rank {r}</text>')
    for e in events[:MAX_TIMELINE_EVENTS]:
        a = e.action
        x, w = left + e.start_s * scale, max(0.5, (e.end_s - e.start_s) * scale)
        y = top + e.rank * row
        parts.append(f'<rect class="act {a.kind}" data-rank="{e.rank}" data-stage="{a.stage}" data-mb="{a.mb}" '
                     f'x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row - 6}" fill="{KIND_COLOR[a.kind]}">'
                     f'<title>{a} ({a.kind} of micro-batch {a.mb} on stage {a.stage}): {duration(e.end_s - e.start_s)}</title></rect>')
        if w > 14:
            parts.append(f'<text x="{x + w / 2:.2f}" y="{y + row / 2 + 1}" font-size="10" fill="#fff" '
                         f'text-anchor="middle">{a.mb}</text>')
        a2a = _a2a_share(est.stages[a.stage], a.kind)
        if a2a is not None:   # its expert-parallel all-to-alls, at the block's end (they are in its time)
            share, seconds = a2a
            parts.append(f'<rect class="a2a" x="{x + w * (1 - share):.2f}" y="{y}" width="{w * share:.2f}" '
                         f'height="{row - 6}" fill="#000" fill-opacity="0.35"><title>expert-parallel all-to-alls of '
                         f'{a}: {duration(seconds)}</title></rect>')
    parts.append(f'<text x="{left}" y="{height - 8}" font-size="11">0</text>'
                 f'<text x="{width - 10}" y="{height - 8}" font-size="11" text-anchor="end">{duration(span)}</text>')
    legend_x = left + 60
    for kind, color in KIND_COLOR.items():
        parts.append(f'<rect x="{legend_x}" y="{height - 18}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{legend_x + 14}" y="{height - 9}" font-size="11">{kind}</text>')
        legend_x += 40
    if len(events) > MAX_TIMELINE_EVENTS:
        parts.append(f'<text x="{legend_x + 20}" y="{height - 9}" font-size="11">first {MAX_TIMELINE_EVENTS:,} of '
                     f'{len(events):,} actions drawn</text>')
    parts.append("</svg>")
    return "".join(parts)


def _a2a_share(st: StageEstimate, kind: str) -> tuple[float, float] | None:
    """(share of the action's time, seconds) of a stage's expert-parallel all-to-alls in one action: the forward's
    in F, the rest (a recomputed forward's too) in B or a split backward's I, none in W (StageEstimate.ep_fwd_s);
    None without them."""
    seconds = st.ep_fwd_s if kind == "F" else st.ep_comm_s - st.ep_fwd_s if kind in ("B", "I") else 0.0
    whole = {"F": st.fwd_s, "B": st.bwd_s, "I": st.bwd_s * st.bwd_input_fraction}.get(kind, 0.0)
    if seconds <= 0 or whole <= 0:
        return None
    return min(1.0, seconds / whole), seconds


def memory_svg(plan: Plan, width: int = 960) -> str:
    groups = _rank_groups(plan)
    cap = plan.prediction.capacity_bytes
    top_value = max([cap] + [m.total_bytes for _, m in groups]) * 1.08
    height, left, bottom = 300, 60, 40
    bar_w = max(8, min(60, (width - left - 20) / max(1, len(groups)) * 0.6))
    step = (width - left - 20) / max(1, len(groups))
    scale = (height - bottom - 20) / top_value
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="memory" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="memory per rank">']
    for i, (label, m) in enumerate(groups):
        x = left + i * step + (step - bar_w) / 2
        y = height - bottom
        for cat, color in MEMORY_COLOR.items():
            h = getattr(m, cat) * scale
            y -= h
            parts.append(f'<rect class="mem {cat}" data-ranks="{html.escape(label)}" x="{x:.2f}" y="{y:.2f}" '
                         f'width="{bar_w:.2f}" height="{h:.2f}" fill="{color}"><title>{html.escape(label)} '
                         f'{cat.replace("_", " ")}: {fixed(getattr(m, cat), "GiB", 3)}</title></rect>')
        parts.append(f'<text x="{x + bar_w / 2:.2f}" y="{height - bottom + 14}" font-size="10" text-anchor="middle">'
                     f'{html.escape(label)}</text>')
    cap_y = height - bottom - cap * scale
    parts.append(f'<line class="capacity" x1="{left}" x2="{width - 10}" y1="{cap_y:.2f}" y2="{cap_y:.2f}" '
                 f'stroke="#d62728" stroke-dasharray="6 4"/><text x="{width - 12}" y="{cap_y - 4:.2f}" font-size="11" '
                 f'text-anchor="end" fill="#d62728">capacity {fixed(cap, "GiB")}</text>')
    legend_x = left
    for cat, color in MEMORY_COLOR.items():
        parts.append(f'<rect x="{legend_x}" y="{height - 16}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{legend_x + 14}" y="{height - 7}" font-size="11">{cat.replace("_", " ")}</text>')
        legend_x += 120
    parts.append("</svg>")
    return "".join(parts)


class _Axis:
    """Value -> pixel along [a, b], logarithmic when the values span a decade or more (a linear axis would crowd
    every point of a 100x range into one corner), with tick values at 1-2-5 steps."""

    def __init__(self, lo: float, hi: float, a: float, b: float, *, log: bool, label_px: float) -> None:
        self.log, self.a, self.b, self.label_px = log, a, b, label_px
        if log:   # 5% margin either side, in log space
            self.lo, self.hi = math.log10(lo) - 0.05 * math.log10(hi / lo), math.log10(hi) + 0.05 * math.log10(hi / lo)
        else:
            self.lo, self.hi = 0.0, hi * 1.05

    def __call__(self, v: float) -> float:
        x = math.log10(max(v, 10**self.lo)) if self.log else v
        return self.a + (x - self.lo) / (self.hi - self.lo) * (self.b - self.a)

    def ticks(self) -> list[float]:
        if self.log:
            first, last = math.floor(self.lo), math.ceil(self.hi)
            # 1-2-5 when the closest pair (1 and 2, log10(2) of a decade apart) leaves room for a label
            px_per_decade = abs(self.b - self.a) / (self.hi - self.lo)
            mantissas = (1, 2, 5) if math.log10(2) * px_per_decade >= self.label_px else (1,)
            vals = [m * 10.0**e for e in range(first, last + 1) for m in mantissas]
            ticks = [v for v in vals if self.lo <= math.log10(v) <= self.hi]
            if len(ticks) >= 3:
                return ticks
            lo, hi = 10**self.lo, 10**self.hi   # a narrow window: evenly spaced 1-2-5 steps instead
            step = _nice_step((hi - lo) / 5)
            return [i * step for i in range(math.ceil(lo / step), math.floor(hi / step) + 1)]
        step = _nice_step(self.hi / 5)
        return [i * step for i in range(int(self.hi / step) + 1)]


def _nice_step(raw: float) -> float:
    """The 1-2-5 number at or above `raw`."""
    e = math.floor(math.log10(raw))
    return next(m * 10.0**e for m in (1, 2, 5, 10) if m * 10.0**e >= raw * (1 - 1e-9))


def _short(text: str) -> str:
    """'2.00 ms' -> '2 ms' for tick labels."""
    num, _, unit = text.partition(" ")
    return (num.rstrip("0").rstrip(".") if "." in num else num) + " " + unit


def _spans(values: list[float]) -> bool:
    pos = [v for v in values if v > 0]
    return bool(pos) and max(pos) >= 10 * min(pos)


def candidates_svg(plan: Plan, width: int = 960, height: int = 320) -> str:
    pts = list(plan.candidates)
    left, bottom, top, right = 70, 40, 15, 20
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="candidates" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="candidates">']
    if not pts:
        parts.append('<text x="10" y="20">no candidates recorded</text></svg>')
        return "".join(parts)
    cap = plan.prediction.capacity_bytes
    times = [p.step_time_s for p in pts if p.step_time_s > 0] or [1.0]
    mems = [m / GIB for m in [cap] + [p.peak_memory_bytes for p in pts]]
    # time is always logarithmic: a one-decade window still reads as ratios; memory only when it spans a decade
    t_lo, t_hi = min(times), max(times)
    if t_hi < 2 * t_lo:
        t_lo, t_hi = t_lo / 1.5, t_hi * 1.5
    ax = _Axis(t_lo, t_hi, left, width - right, log=True, label_px=45)
    mem_log = _spans(mems)
    ay = _Axis(min(m for m in mems if m > 0) if mem_log else 0.0, max(mems), height - bottom, top, log=mem_log,
               label_px=14)
    for v in ax.ticks():
        x = ax(v)
        parts.append(f'<line class="grid" x1="{x:.2f}" x2="{x:.2f}" y1="{top}" y2="{height - bottom}" stroke="#eee"/>'
                     f'<text class="tick x" x="{x:.2f}" y="{height - bottom + 14}" font-size="10" '
                     f'text-anchor="middle">{_short(duration(v))}</text>')
    for v in ay.ticks():
        y = ay(v)
        label = f"{v:g}"
        parts.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y:.2f}" y2="{y:.2f}" stroke="#eee"/>'
                     f'<text class="tick y" x="{left - 4}" y="{y + 3:.2f}" font-size="10" text-anchor="end">'
                     f'{label}</text>')
    for p in pts:
        x, y = ax(p.step_time_s), ay(p.peak_memory_bytes / GIB)
        tip = f"<title>{html.escape(p.label)}: {duration(p.step_time_s)}, {fixed(p.peak_memory_bytes, 'GiB')}" \
              f"{'' if p.fits else ' (does not fit)'}</title>"
        if p.fits:
            parts.append(f'<circle class="cand fits {p.family}" cx="{x:.2f}" cy="{y:.2f}" r="4" fill="#4e79a7" '
                         f'fill-opacity="0.7">{tip}</circle>')
        else:
            parts.append(f'<g class="cand nofit {p.family}"><path d="M{x - 4:.2f},{y - 4:.2f}L{x + 4:.2f},{y + 4:.2f}'
                         f'M{x - 4:.2f},{y + 4:.2f}L{x + 4:.2f},{y - 4:.2f}" stroke="#d62728" stroke-width="1.5"/>{tip}</g>')
    cx, cy = ax(plan.prediction.step_time_s), ay(plan.prediction.peak_memory_bytes / GIB)
    parts.append(f'<circle class="chosen" cx="{cx:.2f}" cy="{cy:.2f}" r="9" fill="none" stroke="#000" stroke-width="2"/>')
    cap_y = ay(cap / GIB)
    parts.append(f'<line class="capacity" x1="{left}" x2="{width - right}" y1="{cap_y:.2f}" y2="{cap_y:.2f}" '
                 f'stroke="#d62728" stroke-dasharray="6 4"/>')
    parts.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{height - bottom}" stroke="#333"/>'
                 f'<line x1="{left}" x2="{width - right}" y1="{height - bottom}" y2="{height - bottom}" stroke="#333"/>'
                 f'<text x="{width - right}" y="{height - 8}" font-size="11" text-anchor="end">step time (log scale)'
                 f'</text><text x="4" y="{top + 10}" font-size="11">GiB{" (log)" if mem_log else ""}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_markdown(plan: Plan, run: RunFile | None = None) -> str:
    out = [f"# zeropipe plan: {plan.model.name} on {plan.gpus} x {plan.cluster.device.name}", ""]
    for sec in sections(plan, run):
        out += [f"## {sec.title}", ""]
        out += [f"- {line}" for line in sec.lines]
        if sec.svg:
            out.append("- (picture in report.html)")
        for headers, rows in sec.tables:
            out += ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
        out.append("")
    return "\n".join(out)


_CSS = ("body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}"
        "th{background:#f4f4f4}h2{border-bottom:1px solid #ddd;padding-bottom:4px}svg{display:block;margin:.5em 0}")


def render_html(plan: Plan, run: RunFile | None = None) -> str:
    title = f"zeropipe plan: {plan.model.name} on {plan.gpus} x {plan.cluster.device.name}"
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{html.escape(title)}</title>",
           f"<style>{_CSS}</style></head><body>", f"<h1>{html.escape(title)}</h1>"]
    for sec in sections(plan, run):
        slug = "".join(ch if ch.isalnum() else "-" for ch in sec.title.lower()).strip("-")
        out.append(f'<section id="{slug}"><h2>{html.escape(sec.title)}</h2>')
        out += [f"<p>{html.escape(line)}</p>" for line in sec.lines]
        out.append(sec.svg)
        for headers, rows in sec.tables:
            out.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr>")
            out += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows]
            out.append("</table>")
        out.append("</section>")
    out.append("</body></html>")
    return "\n".join(out)
