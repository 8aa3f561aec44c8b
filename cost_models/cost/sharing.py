"""CPU ranks that share cores, priced phase by phase over a pipeline step (processor sharing).

The estimate prices a CPU rank's compute at the contention of the ranks busy on average over the step
(estimate.busy_ranks, compute.contention). A pipeline of few micro-batches is not average: PP2 x DP2 at one
micro-batch on 4 ranks over fewer cores runs its forwards two ranks at a time (the other two wait for their input)
and part of its backward four at a time (the first stage's backward beside the last stage's weight-backward). Per
action, the wall time then ranges from about the action's CPU time (two busy) to about twice it (four busy), where
the step's average prices every action alike (measured per action: benchmarks/results/measurements.md, "Processor
sharing in a pipeline step").
Processor sharing (each of k busy ranks progresses at min(1, cores / k) of its speed alone) is the standard model
of a time-shared CPU (Kleinrock 1967, "Time-shared systems: a theoretical treatment", J. ACM 14(2)): here every
action is stretched by max(1, ranks busy / effective cores) integrated over its run, per stage and action kind
(F, B or I, W), and the schedule re-simulated with the stretched durations (ROUNDS times)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from cost_models.records.base import Record, record
from cost_models.cost.simulator import Event, StageCost, schedule_timeline

# Re-simulations, each from the busy ranks of the previous one's timeline: over the fidelity configurations, 3
# rounds price every step as 6 do and one round does not (benchmarks/results/measurements.md, "Processor sharing
# in a pipeline step").
ROUNDS = 3


@record
class Stretch(Record):
    """One stage's slowdown per action kind relative to the contention its costs were priced at."""
    fwd: float = 1.0
    bwd: float = 1.0       # B, or I under a split backward
    weight: float = 1.0    # W under a split backward


def mean_slowdown(events: Sequence[Event], replicas: int, cores: float) -> list[float]:
    """Per event, how much slower than alone it runs on average: max(1, busy / cores) integrated over the event,
    where busy is `replicas` (the dp x tp ranks that run each pipeline rank's schedule at the same time) x the
    pipeline ranks with an action in progress, the event's own included."""
    edges = sorted({e.start_s for e in events} | {e.end_s for e in events})
    index = {t: i for i, t in enumerate(edges)}
    delta = [0] * len(edges)
    for e in events:
        delta[index[e.start_s]] += 1
        delta[index[e.end_s]] -= 1
    area, running = [0.0], 0   # area[i]: the integral of the slowdown from edges[0] to edges[i]
    for i in range(len(edges) - 1):
        running += delta[i]
        area.append(area[-1] + max(1.0, replicas * running / cores) * (edges[i + 1] - edges[i]))
    out = []
    for e in events:
        span = e.end_s - e.start_s
        out.append((area[index[e.end_s]] - area[index[e.start_s]]) / span if span > 0
                   else max(1.0, replicas / cores))
    return out


def stretched_backward(bwd_s: float, input_fraction: float, x: Stretch) -> tuple[float, float]:
    """(backward, its input-gradient fraction) with the input part (I, or B unsplit) stretched by x.bwd and the
    weight part by x.weight (equal for a stage whose backward is not split: stretches)."""
    scale = input_fraction * x.bwd + (1.0 - input_fraction) * x.weight
    return bwd_s * scale, (input_fraction * x.bwd / scale if scale > 0 else input_fraction)


def _apply(cost: StageCost, x: Stretch) -> StageCost:
    """A stage's cost with its actions stretched; the gathers it waits for once (first_*_extra_s) are not."""
    bwd, frac = stretched_backward(cost.bwd_s, cost.bwd_input_fraction, x)
    return dataclasses.replace(cost, fwd_s=cost.fwd_s * x.fwd, bwd_s=bwd, bwd_input_fraction=frac)


def stretches(schedule: str, p: int, m: int, v: int, costs: tuple[StageCost, ...], *, replicas: int,
              cores: float, priced_at: float, send_delay_s: float = 0.0) -> tuple[Stretch, ...]:
    """Per stage, how much longer (or shorter) its actions run than `costs` say, for CPU ranks that share `cores`
    effective cores: each kind's duration-weighted mean_slowdown over `priced_at`, the contention the costs were
    priced at (compute.contention of estimate.busy_ranks). ROUNDS re-simulations."""
    current = costs
    out = tuple(Stretch() for _ in costs)
    for _ in range(ROUNDS):
        events = schedule_timeline(schedule, p, m, v, current, send_delay_s=send_delay_s).timeline
        acc: dict[tuple[int, str], list[float]] = {}
        for e, slow in zip(events, mean_slowdown(events, replicas, cores)):
            span = e.end_s - e.start_s
            a = acc.setdefault((e.action.stage, "B" if e.action.kind == "I" else e.action.kind), [0.0, 0.0])
            a[0] += span * slow
            a[1] += span
        factor = {k: (x / y if y > 0 else 1.0) / priced_at for k, (x, y) in acc.items()}
        # a stage without W actions runs its whole backward as B: its weight part is B's too
        out = tuple(Stretch(fwd=factor.get((sid, "F"), 1.0), bwd=factor.get((sid, "B"), 1.0),
                            weight=factor.get((sid, "W"), factor.get((sid, "B"), 1.0))) for sid in range(len(costs)))
        current = tuple(_apply(c, x) for c, x in zip(costs, out))
    return out
