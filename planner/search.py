"""`plan()`: search the space, cost each surviving point with cost_models.estimate, rank, and explain.

Search: enumerate (planner.space), prune what provably cannot win, cost the rest in order of a lower bound,
branch-and-bound against the k-th best feasible time found so far:
  P1 memory bound: a stage holds at least max(Ψ / pp, largest unit) parameters; if those model states plus the
     per-process overhead exceed the device, no partition, schedule or micro-batching of that (dp, pp, ZeRO) fits;
  P2 time bound: the busiest rank computes at least m * (sum of unit forward + backward) / pp; a point whose bound
     is not below the k-th best predicted time cannot enter the top k.
A point that does not fit with time-balanced stages is retried with recompute on the stages that overflow, then
with the memory-aware exact DP partition.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable

from cost_models.cluster import ClusterProfile
from cost_models.compute import unit_times
from cost_models.errors import ConfigError, InfeasibleError
from cost_models.estimate import Estimate, activation_scale, estimate, tied_copies
from cost_models.formatting import fixed, now_utc
from cost_models.limits import MAX_MICROBATCHES
from cost_models.memory import OVERHEAD_BYTES, executor_state_bytes, zero_model_state_bytes
from cost_models.profile import ModelProfile
from cost_models.schedule import get_spec
from cost_models.strategy import Strategy
from planner.partition import (PartitionInfeasible, PartitionProblem, balanced_partition, dag_partition, dp_partition,
                               milp_partition, stages_from_ranges)
from planner.plan import Alternative, Candidate, Plan, Provenance, installed_versions, model_ref, profile_digest
from planner.rationale import explain, why_lost
from planner.request import PlanRequest
from planner.space import MAX_MICRO_BATCH, Point, enumerate_points

ProgressFn = Callable[[int, int], None]


@dataclass
class _Costed:
    point: Point
    strategy: Strategy
    estimate: Estimate


class _Partitions:
    """Stage cuts per stage count, balanced on predicted unit time (independent of micro-batch size: times scale
    linearly), computed once per stage count."""

    def __init__(self, profile: ModelProfile, unit_cost: list[float]) -> None:
        self.profile, self.unit_cost, self.cache, self.bottlenecks = profile, unit_cost, {}, {}
        self.names = [u.name for u in profile.units]

    def min_bottleneck(self, k: int) -> float:
        """The least possible largest stage (per micro-batch at the profile's batch) over all contiguous splits."""
        if k not in self.bottlenecks:
            prefix = [0.0]
            for c in self.unit_cost:
                prefix.append(prefix[-1] + c)
            self.bottlenecks[k] = max(prefix[b] - prefix[a] for a, b in balanced_partition(self.unit_cost, k))
        return self.bottlenecks[k]

    def stages(self, k: int) -> tuple[tuple[str, ...], ...]:
        if k not in self.cache:
            if self.profile.is_chain:
                ranges = balanced_partition(self.unit_cost, k)
                self.cache[k] = stages_from_ranges(self.names, ranges)
            else:
                edges = [(e.src, e.dst, float(e.bytes)) for e in self.profile.edges]
                self.cache[k] = tuple(tuple(self.names[u] for u in st) for st in dag_partition(self.unit_cost, edges, k))
        return self.cache[k]


def runnable(schedule: str, zero: int, dp: int) -> bool:
    """Combinations the executor cannot run correctly are never planned: the schedule registry's guard
    (cost_models.schedule.ScheduleSpec.unsafe says which, and why)."""
    return get_spec(schedule).unsafe(zero, dp) is None


def _strategy(point: Point, stages, *, precision: str, optimizer: str, recompute=()) -> Strategy:
    return Strategy(dp=point.dp, pp=point.pp, zero=point.zero, schedule=point.schedule, microbatches=point.microbatches,
                    micro_batch_size=point.micro_batch_size, v=point.v, stages=stages, recompute=tuple(recompute),
                    precision=precision, optimizer=optimizer)


def _memory_aware_stages(point: Point, profile: ModelProfile, cluster: ClusterProfile, est: Estimate,
                         unit_cost: list[float], *, precision: str, optimizer: str):
    """The exact DP with per-stage memory (in-flight counts from the first estimate's schedule)."""
    # bytes per parameter at rest as the executor holds them (FSDP2 shards ZeRO-2's parameters too)
    per_param = sum(executor_state_bytes(1.0, point.dp, point.zero, precision, optimizer))
    act_scale = activation_scale(profile, micro_batch_size=point.micro_batch_size, precision=precision)
    problem = PartitionProblem(
        costs=tuple(unit_cost), n_stages=point.pp * point.v,
        # every tied parameter a unit uses, wherever the cut puts its owner (an upper bound)
        state_bytes=tuple((u.params + sum(tied_copies(profile, u.name, ()))) * per_param for u in profile.units),
        act_bytes=tuple(u.saved_bytes * act_scale for u in profile.units),
        in_flight=tuple(max(1, st.peak_in_flight) for st in est.stages),
        capacity=(cluster.device.memory_bytes - OVERHEAD_BYTES[cluster.device.kind]) / point.v)
    return stages_from_ranges([u.name for u in profile.units], dp_partition(problem))


def _cost_point(point: Point, profile: ModelProfile, cluster: ClusterProfile, parts: _Partitions,
                unit_cost: list[float], *, precision: str, optimizer: str) -> tuple[list[_Costed], int]:
    """Estimate a point; if it does not fit, retry with recompute on overflowing stages, then memory-aware stages.
    Returns every estimate made (the last is the best attempt) and how many were made."""
    stages = parts.stages(point.pp * point.v)
    strategy = _strategy(point, stages, precision=precision, optimizer=optimizer)
    attempts = [_Costed(point, strategy, estimate(strategy, profile, cluster, compact=True))]
    if attempts[-1].estimate.fits:
        return attempts, 1
    cap = cluster.device.memory_bytes
    over = {sid for m in attempts[-1].estimate.memory_per_rank if m.total_bytes > cap for sid in m.stages}
    recompute = tuple(i in over for i in range(point.pp * point.v))
    strategy = _strategy(point, stages, precision=precision, optimizer=optimizer, recompute=recompute)
    attempts.append(_Costed(point, strategy, estimate(strategy, profile, cluster, compact=True)))
    if attempts[-1].estimate.fits or point.pp * point.v == 1:
        return attempts, 2
    try:
        stages = _memory_aware_stages(point, profile, cluster, attempts[0].estimate, unit_cost,
                                      precision=precision, optimizer=optimizer)
    except PartitionInfeasible:
        return attempts, 2
    strategy = _strategy(point, stages, precision=precision, optimizer=optimizer)
    if strategy.split_tie(sp.units for sp in profile.shared):   # the new cut put a tie's stages on one rank
        return attempts, 2
    attempts.append(_Costed(point, strategy, estimate(strategy, profile, cluster, compact=True)))
    return attempts, 3


@dataclass
class SearchResult:
    feasible: list[_Costed]          # costed points that fit, fastest first (full estimates for the first top_k,
                                     # every rank listed for the first)
    infeasible: list[_Costed]        # costed points (and unconstrained first attempts) that do not fit
    considered: int
    pruned: int
    costed: int
    pruned_bounds: dict[str, float]  # family -> least time bound among points P2 pruned
    min_state: float                 # the least model-state bytes any point needs (P1's bound)
    unit_cost: list[float]
    gpus: int                        # the GPU count searched (the request's, or the cluster's)


def _points(profile: ModelProfile, gpus: int, req: PlanRequest, parts: "_Partitions") -> list[Point]:
    """The space (planner.space) less what the executor cannot run and what the request narrows away."""
    n_units = len(profile.units)
    ties = tuple(sp.units for sp in profile.shared)
    pipelines = profile.pipeline_refusal is None
    points = [pt for pt in enumerate_points(gpus=gpus, global_batch=req.global_batch_size, n_units=n_units,
                                            pipelines=pipelines)
              if runnable(pt.schedule, pt.zero, pt.dp)
              and (req.schedules is None or pt.pp == 1 or pt.schedule in req.schedules)
              and (req.micro_batch_sizes is None or pt.micro_batch_size in req.micro_batch_sizes)
              and (req.max_v is None or pt.v <= req.max_v)
              and not _splits_tie(pt, parts, ties, req)]
    if points:
        return points
    if next(enumerate_points(gpus=gpus, global_batch=req.global_batch_size, n_units=n_units,
                             max_microbatches=req.global_batch_size, pipelines=pipelines), None) is not None:
        raise ConfigError(f"every split of {gpus} devices needs more than {MAX_MICROBATCHES:,} micro-batches of "
                          f"up to {MAX_MICRO_BATCH} sequences for the global batch {req.global_batch_size}, more than "
                          f"this planner simulates; lower --global-batch-size or add --gpus")
    if not pipelines:
        raise ConfigError(f"dp = {gpus} does not divide the global batch {req.global_batch_size}, and pp > 1 is not "
                          f"offered ({profile.name} cannot be pipelined: {profile.pipeline_refusal}); use a batch "
                          f"divisible by {gpus}")
    raise ConfigError(f"no (dp, pp) split of {gpus} devices divides the global batch {req.global_batch_size}; "
                      f"use a batch divisible by the data-parallel degree")


def _splits_tie(pt: Point, parts: "_Partitions", ties, req: PlanRequest) -> bool:
    """The schedule cannot train a tied parameter whose stages share a rank (ScheduleSpec.same_rank_tie)."""
    if pt.pp == 1 or not ties or not get_spec(pt.schedule).same_rank_tie:
        return False
    return _strategy(pt, parts.stages(pt.pp * pt.v), precision=req.precision, optimizer=req.optimizer).split_tie(ties) is not None


def _bounded(points: list[Point], profile: ModelProfile, cluster: ClusterProfile, parts: "_Partitions",
             req: PlanRequest) -> tuple[list[tuple[float, Point]], int, float]:
    """P1 (module doc) drops points whose model states cannot fit; the rest get P2's time bound, least first.
    Returns (bound, point) pairs, how many P1 pruned, and the least model-state bytes any point needs."""
    largest_unit = max(u.params for u in profile.units)
    overhead = OVERHEAD_BYTES[cluster.device.kind]
    total_cost = sum(parts.unit_cost)
    survivors, pruned, min_state = [], 0, math.inf
    for pt in points:
        held = max(profile.total_params / pt.pp, largest_unit)
        state = sum(zero_model_state_bytes(held, pt.dp, pt.zero, req.precision, req.optimizer)) + overhead
        min_state = min(min_state, state)
        if state > cluster.device.memory_bytes:               # P1
            pruned += 1
            continue
        # P2's bound: the busiest rank does m micro-batches of at least its share (with one contiguous stage per
        # rank, at least the least possible bottleneck), and micro-batch 0 must pass every unit.
        scale = pt.micro_batch_size / profile.micro_batch_size
        rank_share = parts.min_bottleneck(pt.pp) if pt.v == 1 else total_cost / pt.pp
        survivors.append((max(pt.microbatches * rank_share, total_cost) * scale, pt))
    survivors.sort(key=lambda x: x[0])
    return survivors, pruned, min_state


def search(profile: ModelProfile, cluster: ClusterProfile, request: PlanRequest, *,
           on_progress: ProgressFn | None = None) -> SearchResult:
    """Enumerate, prune and cost (module doc). request.prune=False costs every point P1 lets through (the fidelity
    benchmark runs them all); request.schedules / micro_batch_sizes / max_v narrow the space."""
    req = request
    gpus = req.resolved_gpus(cluster)
    unit_cost = [sum(unit_times(u, profile, cluster, micro_batch_size=profile.micro_batch_size, precision=req.precision,
                                ranks_running=gpus)) for u in profile.units]
    parts = _Partitions(profile, unit_cost)
    points = _points(profile, gpus, req, parts)
    survivors, pruned, min_state = _bounded(points, profile, cluster, parts, req)
    feasible: list[_Costed] = []
    infeasible: list[_Costed] = []
    pruned_bounds: dict[str, float] = {}   # family -> least time bound among points P2 pruned (sorted: first seen)
    costed = 0
    for i, (bound, pt) in enumerate(survivors):
        if on_progress and i % 25 == 0:
            on_progress(i, len(survivors))
        if req.prune and len(feasible) >= req.top_k:
            kth = sorted(c.estimate.step_time_s for c in feasible)[req.top_k - 1]
            if bound >= kth:                                   # P2
                pruned += len(survivors) - i
                for later_bound, later in survivors[i:]:
                    pruned_bounds.setdefault(later.family, later_bound)
                break
        attempts, n = _cost_point(pt, profile, cluster, parts, unit_cost, precision=req.precision,
                                  optimizer=req.optimizer)
        costed += n
        best = attempts[-1]
        (feasible if best.estimate.fits else infeasible).append(best)
        if not best.estimate.fits or len(attempts) > 1:
            infeasible.append(attempts[0])  # the unconstrained version, for "memory binds" in the rationale
    if on_progress:
        on_progress(len(survivors), len(survivors))
    feasible.sort(key=lambda c: (c.estimate.step_time_s, c.estimate.peak_memory_bytes))
    # full estimates (bubble and p2p apart) for what a plan shows; only the winner's lists every rank (memory and
    # action order: the plan file's prediction), the alternatives keep one memory entry per pipeline rank
    feasible[:req.top_k] = [replace(c, estimate=estimate(c.strategy, profile, cluster, per_rank=i == 0))
                            for i, c in enumerate(feasible[:req.top_k])]
    return SearchResult(feasible=feasible, infeasible=infeasible, considered=len(points), pruned=pruned, costed=costed,
                        pruned_bounds=pruned_bounds, min_state=min_state, unit_cost=unit_cost, gpus=gpus)


def _no_fit(found: SearchResult, capacity: int, no_pipelines: str | None) -> InfeasibleError:
    if found.infeasible:
        least = min(c.estimate.peak_memory_bytes for c in found.infeasible)
        need = f"the least memory any strategy needs is {fixed(least, 'GiB', 1)} per device"
    else:  # every point failed the model-state bound P1 before costing
        need = f"model states alone need at least {fixed(found.min_state, 'GiB', 1)} per device"
    tried = (f"ZeRO-3, full recompute and micro-batches down to 1 were tried; pipelines were not, the model cannot "
             f"be pipelined: {no_pipelines}" if no_pipelines else
             "ZeRO-3, full recompute, micro-batches down to 1 and every pipeline depth were tried")
    return InfeasibleError(
        f"no strategy fits: {need}, the device has {fixed(capacity, 'GiB', 1)}; use more GPUs (--gpus/--nodes) "
        f"or a device with more memory ({tried})")


def plan(profile: ModelProfile, cluster: ClusterProfile, request: PlanRequest, *, profile_path: str = "",
         command: str = "", on_progress: ProgressFn | None = None) -> Plan:
    """Search every strategy the request allows on `cluster`; return the Plan with its rationale and provenance."""
    t0 = time.perf_counter()
    found = search(profile, cluster, request, on_progress=on_progress)
    feasible, infeasible = found.feasible, found.infeasible
    if not feasible:
        raise _no_fit(found, cluster.device.memory_bytes, profile.pipeline_refusal)
    winner = feasible[0]
    alternatives = tuple(
        Alternative(strategy=c.strategy, step_time_s=c.estimate.step_time_s, peak_memory_bytes=c.estimate.peak_memory_bytes,
                    fits=True, lost_because=why_lost(c.strategy, c.estimate, winner.strategy, winner.estimate))
        for c in feasible[1:request.top_k])
    fastest_unfit = min(infeasible, key=lambda c: c.estimate.step_time_s, default=None)
    rationale = explain(winner.strategy, winner.estimate, feasible, fastest_unfit, cluster, found.pruned_bounds,
                        no_pipelines=profile.pipeline_refusal)
    provenance = _provenance(found, winner, profile, cluster, request, profile_path=profile_path, command=command,
                             t0=t0)
    s = winner.strategy
    return Plan(model=model_ref(profile), cluster=cluster, gpus=found.gpus, global_batch_size=request.global_batch_size,
                strategy=s, stage_ranks=tuple(s.stage_ranks(i) for i in range(s.n_stages)), prediction=winner.estimate,
                alternatives=alternatives, candidates=_candidates(feasible + infeasible), rationale=rationale,
                provenance=provenance)


def _candidates(costed: list[_Costed]) -> tuple[Candidate, ...]:
    """One scatter-plot point per distinct strategy name and fit (the report's candidates chart)."""
    seen, out = set(), []
    for c in costed:
        key = (c.strategy.name, c.estimate.fits)
        if key not in seen:
            seen.add(key)
            out.append(Candidate(label=key[0], family=c.strategy.family, step_time_s=c.estimate.step_time_s,
                                 peak_memory_bytes=c.estimate.peak_memory_bytes, fits=c.estimate.fits))
    return tuple(out)


def _provenance(found: SearchResult, winner: _Costed, profile: ModelProfile, cluster: ClusterProfile,
                request: PlanRequest, *, profile_path: str, command: str, t0: float) -> Provenance:
    partitioner, milp_status, milp_b, dp_b = _partition_provenance(winner, profile, found.unit_cost,
                                                                   request.time_limit_s)
    return Provenance(
        profile_path=profile_path, profile_digest=profile_digest(profile_path) if profile_path else "",
        cluster=cluster.name, partitioner=partitioner, milp_status=milp_status, milp_bottleneck_s=milp_b,
        dp_bottleneck_s=dp_b, points_considered=found.considered, points_pruned=found.pruned,
        points_costed=found.costed, planning_time_s=time.perf_counter() - t0,
        versions=installed_versions(), command=command, created_at=now_utc())


def _partition_provenance(winner: _Costed, profile: ModelProfile, unit_cost: list[float],
                          time_limit_s: float) -> tuple[str, str, float | None, float | None]:
    """Solve the winner's stage cut again as a MILP and with the exact DP; record both bottlenecks and the status."""
    s = winner.strategy
    if s.n_stages == 1:
        return ("none (one stage)", "not needed", None, None)
    if not profile.is_chain:
        return ("dag-networkx", "not run (the MILP models chains)", None, None)
    scale = s.micro_batch_size / profile.micro_batch_size
    problem = PartitionProblem(costs=tuple(c * scale for c in unit_cost), n_stages=s.n_stages)
    dp_ranges = dp_partition(problem)
    try:
        _, status, objective = milp_partition(problem, time_limit_s=time_limit_s)
    except InfeasibleError as exc:
        return ("chain-dp", f"failed: {exc}", None, problem.bottleneck(dp_ranges))
    return ("chain-dp", status, objective, problem.bottleneck(dp_ranges))
