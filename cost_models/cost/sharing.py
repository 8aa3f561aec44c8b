"""CPU ranks that share cores: every correction the estimate makes for it, in one place.

GPUs compute alone; CPU ranks share the host's cores, so each computes slower the more compute at once. Here:
  * effective_cores: how many ranks' worth of compute the host gives (the cluster probe's matmul rates);
  * busy_ranks, contention, memory_contention: the step's average slowdown of compute and of memory-bound work;
  * stretches: the same phase by phase over a pipeline step (processor sharing, below);
  * send_delay: how long a gloo send waits for a core while every core is busy;
  * action_seconds: torch's per-action pipeline runtime cost with the plan's pipelines running at once.
On GPUs every one of them is the identity (1.0, 0 s, or the probe's value).

The estimate prices a CPU rank's compute at the contention of the ranks busy on average over the step
(busy_ranks, contention). A pipeline of few micro-batches is not average: PP2 x DP2 at one
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

from cost_models.cost.simulator import Event, StageCost, schedule_timeline
from cost_models.records.base import Record, record
from cost_models.records.cluster import ClusterProfile, ComputeProbe
from cost_models.records.strategy import Strategy

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
    priced at (contention of busy_ranks). ROUNDS re-simulations."""
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


def effective_cores(cluster: ClusterProfile, ranks_running: float | None = None) -> float | None:
    """How many ranks' worth of compute the CPU ranks get together: the probe's ranks x each one's FLOP/s while all
    run, over one rank's alone (about the cores, measured: benchmarks/results/measurements.md, "Compute contention
    on shared cores"). None on GPUs or without a probe.

    Other programs' runnable tasks (ComputeProbe.background_runnable, b) take their share: processor sharing
    (Kleinrock 1967, the module doc) gives each of k busy ranks cores / (k + b), as if the ranks alone had
    cores x k / (k + b) (`ranks_running` = k). The probe's own ratio ran beside them too, which hides them (its
    alone rate shared the cores as well): the cores are then taken as that ratio x (ranks + b) / ranks.
    Either way at most the cores the host gives the ranks (ComputeProbe.host_cores): no more rank-threads run at
    once than there are cores, and a ratio above that is the probe's noise (each rank times its own window)."""
    c = cluster.compute
    if cluster.device.kind != "cpu" or c is None or c.flops_alone <= 0:
        return None
    cores = c.ranks * c.flops_per_rank / c.flops_alone
    b, share = c.background_runnable, 1.0
    if b > 0 and ranks_running is not None and ranks_running > 0:
        cores, share = cores * (c.ranks + b) / c.ranks, ranks_running / (ranks_running + b)
    return (min(cores, c.host_cores) if c.host_cores > 0 else cores) * share


def contention(cluster: ClusterProfile, ranks_running: float) -> float:
    """How much slower each of `ranks_running` CPU ranks computes than one rank alone (1.0 on GPUs)."""
    cores_eff = effective_cores(cluster, ranks_running)
    return 1.0 if cores_eff is None else max(1.0, ranks_running / cores_eff)


def memory_contention(cluster: ClusterProfile, ranks_running: float) -> float:
    """How much slower each of `ranks_running` CPU ranks runs memory-bound work (the optimizer step) than one rank
    alone: the probe's copy bandwidth alone over all ranks' (ComputeProbe.copy_alone_Bps), linear in the ranks
    running between 1 (one) and that ratio (all), and never below the compute contention (cores are shared too).
    Where the probe did not measure it (older files), the compute contention."""
    c = cluster.compute
    core = contention(cluster, ranks_running)
    if cluster.device.kind != "cpu" or c is None or c.copy_alone_Bps <= 0 or c.copy_Bps <= 0 or c.ranks <= 1:
        return core
    full = c.copy_alone_Bps / c.copy_Bps
    share = min(1.0, max(0.0, (ranks_running - 1) / (c.ranks - 1)))
    return max(core, 1.0 + (full - 1.0) * share)


def busy_ranks(s: Strategy) -> float:   # s: a Strategy, or the planner's search Point (the same fields)
    """How many ranks compute at once, on average over a step: all of them without a pipeline; with one, each
    pipeline rank is busy n / (n + p - 1) of the time for n = m x v micro-batch chunks (the bubble fraction
    (p - 1) / (m + p - 1) of GPipe, Huang et al. 2019, section 2.3, and (p - 1) / (v m) interleaved, Narayanan et
    al. 2021, section 2.2). CPU ranks that share cores slow each other by how many compute at once
    (contention): a 4-stage pipeline of one micro-batch on 4 ranks over fewer cores runs one stage at a
    time, at full speed (priced at every rank's contention it came out far too slow: measured in
    benchmarks/results/measurements.md, "Compute contention on shared cores")."""
    n = s.microbatches * s.v
    return s.dp * s.tp * s.pp * n / (n + s.pp - 1)


# The most a gloo send waits for a core when every core is busy: the median of the plateau benchmarks/send_delay.py
# measures with twice as many ranks as cores (benchmarks/results/send_delay.json; measurements.md, "CPU pipeline
# sends wait for a core"). A scheduler's time slice, not a link's cost.
SEND_DELAY_CAP_S = 3.8e-3


def send_delay(s: Strategy, cluster: ClusterProfile) -> float:
    """How long a pipeline's sends may wait for the sender's next wait (simulator._evaluate), on average over its
    sends: SEND_DELAY_CAP_S while every core is busy, none while one is free (gloo's I/O thread then runs at once;
    NCCL's transfers need no core). CPU ranks only. The share of a step with every core busy is taken as the ranks
    computing at once beyond one less than the probe's effective cores (busy_ranks; effective_cores),
    clamped to [0, 1]: a pipeline of one micro-batch runs one rank at a time (little or no delay), one of many
    micro-batches on more ranks than cores keeps them all busy (the cap). Scored offline against fidelity
    measurements: benchmarks/results/measurements.md, "CPU pipeline sends wait for a core"."""
    cores = effective_cores(cluster, busy_ranks(s))
    if cores is None:
        return 0.0
    return SEND_DELAY_CAP_S * min(1.0, max(0.0, busy_ranks(s) - (cores - 1.0)))


def action_seconds(probe: "ComputeProbe", *, multi_stage: bool, split_backward: bool,
                   pipelines_at_once: float) -> float:
    """One pipeline action's overhead for a schedule of that kind (torch's single-stage classes, its multi-stage
    runtime, that runtime with the backward split) when `pipelines_at_once` pipelines run together (the plan's
    dp x tp); a kind not probed (older cluster files) costs as the first.

    The probe measured two shapes (overhead_probe): every pair of ranks at once (probe.ranks // 2 pipelines) and
    one pipeline over all ranks; a plan between them is interpolated linearly in its pipelines at once, and a
    probe of one shape only (2 ranks, older files) gives the pairs' value. On CPU ranks sharing cores the two
    differ, either way round depending on the schedule kind (measured: benchmarks/results/measurements.md,
    "Pipeline action overhead")."""
    def kind(prefix: str) -> tuple[float, float]:
        return getattr(probe, prefix + "_s"), getattr(probe, prefix + "_one_s")
    pairs, one = kind("pipeline_action")
    if multi_stage:
        value = kind("pipeline_split_action" if split_backward else "pipeline_runtime_action")
        if value[0] > 0:
            pairs, one = value
    most = probe.ranks // 2   # 3 ranks: one pair at a time, one pipeline is the only other shape
    if one <= 0:
        return pairs
    share = 0.0 if most <= 1 else min(1.0, max(0.0, (pipelines_at_once - 1) / (most - 1)))
    return one + (pairs - one) * share


@dataclasses.dataclass(frozen=True)
class CoreSharing:
    """How CPU ranks sharing cores slow one strategy's work: what every pass of the estimate reads, computed once
    per estimate (core_sharing). On GPUs nothing is shared: cores None, contention 1, no send delay."""

    busy: float              # ranks computing at once on average over the step (busy_ranks)
    cores: float | None      # effective cores (effective_cores); None on GPUs or without a probe
    contention: float        # each busy rank's compute slowdown over one rank alone, at `busy`
    send_delay_s: float      # how long a pipeline send waits for a core (send_delay)


def core_sharing(s: Strategy, cluster: ClusterProfile) -> CoreSharing:
    busy = busy_ranks(s)
    return CoreSharing(busy=busy, cores=effective_cores(cluster, busy), contention=contention(cluster, busy),
                       send_delay_s=send_delay(s, cluster))
