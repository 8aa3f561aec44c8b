"""`plan()`: search the space, cost each surviving point with cost_models.cost.estimate, rank, and explain.

Search: enumerate (planner.space: tp x sp x pp x micro-batching x schedule x ZeRO), prune what cannot win, cost
the rest in order of a lower bound (a heap), branch-and-bound against the k-th best feasible time found so far:
  P1 memory bound: a stage holds at least max(Ψ / pp, largest unit) / tp parameters; if those model states plus the
     per-process overhead exceed the device, no partition, schedule or micro-batching of that (dp, pp, tp, ZeRO)
     fits;
  P2 time bound (_schedule_bound, _point_bound): every pipeline rank does its stages' work for all m micro-batches
     (unit times as the estimate prices them at that tp and SP, TP collectives included: _UnitTimes), starts only
     when micro-batch 0's forward reaches it, and ends before the stages ahead run their last backward (without
     split backward) and before its exposed data-parallel collectives end; the optimizer step comes on top;
  P3 no retry: a point that does not fit is retried with recompute or memory-aware stages only if its first
     estimate is faster than the k-th best (recompute adds work; a memory-aware cut's bottleneck is no less than
     the balanced one's: the one assumption here that is not a theorem of the estimate);
  P4 group bound: points that differ only in ZeRO stage 0 / 1 share the simulated schedule (the estimate adds data-
     parallel collectives and the optimizer after it; ZeRO-2 and 3, whose gathers a pipeline may simulate inside
     it, are groups of their own), so a costed member raises the others' bound to its makespan;
  P5 recompute bound: one stage (pp = v = 1) that cannot hold one micro-batch's activations even with selective
     recompute and everything divided by tp must recompute fully: its forward runs twice;
  P6 / P7 recompute first: a pipeline rank that cannot hold its model states and its activations with selective
     recompute (the forwards its schedule runs before its first backward, all alive at once, and at least one
     micro-batch of its largest stage; or the activations in flight another member of the group was estimated
     with) is costed with full recompute on its stages first: no estimate of what cannot fit; P6's ranks (found
     before costing) run their forward twice in the point's bound, and such a point is not re-cut memory-aware
     (the planner's policy: a rank that cannot hold its warm-up's activations recomputes);
  P8 recompute floor: such a point (P6 / P7, never re-cut) where a pipeline rank cannot hold its model states and,
     per forward it runs before its first backward, the least its stage keeps under any attempt (full recompute's
     unit inputs where recompute frees memory, the selective floor on one tp rank where that is less) is not
     costed: none of its attempts fits. The same for one stage (pp = v = 1, never re-cut), one micro-batch alive.
A point that does not fit with time-balanced stages is retried with selective recompute, full recompute on the
stages that overflow, then the memory-aware exact DP partition. Unit times are assumed no faster at larger tp per
FLOP (the estimate's narrow-GEMM curve) and per sample at smaller micro-batches (fixed costs spread over fewer).
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import gc
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple, Sequence, cast

import numpy as np

from cost_models.cost.comm import collective_time, group_ranks_per_node
from cost_models.cost.compute import executed_precision
from cost_models.cost.context_parallel import cp_view
from cost_models.cost.estimate import (Estimate, activation_scale, dtype_ratio, estimate,
                                       held_params, optimizer_seconds, saved_bytes, unit_costs, unit_seconds)
from cost_models.cost.memory import (comm_buffer_bytes, executor_state_bytes, overhead_bytes, saved_parts,
                                     tp_saved_bytes, zero_model_state_bytes)
from cost_models.cost.moe import check_ep, imbalance_source
from cost_models.cost.sharing import busy_ranks
from cost_models.records.cluster import Calibration, ClusterProfile
from cost_models.records.errors import ConfigError, InfeasibleError
from cost_models.records.formatting import fixed, now_utc
from cost_models.records.limits import MAX_MICROBATCHES
from cost_models.records.precision import BYTES_PER_PARAM, Optimizer, Precision
from cost_models.records.profile import ModelProfile, UnitProfile
from cost_models.records.schedule import SCHEDULES, forwards_before_backward, get_spec, placement
from cost_models.records.strategy import Strategy
from planner.partition import (PartitionInfeasible, PartitionProblem, balanced_partition, dag_partition, dp_partition,
                               milp_partition, stages_from_ranges)
from planner.plan import Alternative, Candidate, Plan, Provenance, installed_versions, model_ref, profile_digest
from planner.rationale import cp_lines, ep_lines, explain, tp_lines, why_lost
from planner.request import PlanRequest
from planner.space import (MAX_MICRO_BATCH, Point, TPOptions, cp_degrees, enumerate_points, ep_degrees,
                           tp_options)
from planner.summaries import profile_conditions

ProgressFn = Callable[[int, int], None]


@dataclass
class _Costed:
    point: Point
    strategy: Strategy
    estimate: Estimate


class _Partitions:
    """Stage cuts per stage count, balanced on predicted unit time at the profile's micro-batch (one cut for every
    micro-batch size), computed once per stage count."""

    def __init__(self, profile: ModelProfile, unit_fb: list[tuple[float, float]], *, dtype_ratio: float,
                 at_batch: Callable[[int], list[tuple[float, float]]] | None = None, cp: int = 1) -> None:
        self.profile, self.unit_fb, self.cp = profile, unit_fb, cp
        self.cache: dict[int, tuple[tuple[str, ...], ...]] = {}
        self.bottlenecks: dict = {}
        # unit_fb at another micro-batch, as the estimate moves measured times (affine, compute._at_batch): None
        # scales unit_fb linearly
        self.at_batch = at_batch
        self.dtype_ratio = dtype_ratio   # the plan's compute dtype's element size over the profile's
        self.unit_cost = [f + b for f, b in unit_fb]
        self.names = [u.name for u in profile.units]
        # per-cut caches, keyed by what they are: (k, mbs) -> (forward, backward) per stage, ('params', k) ->
        # parameters per stage, ('ids', k), ('kept', k, tp, sp, shard), ('unit kept', tp, sp, shard), ...
        self.fb: dict = {}

    def stage_params(self, k: int) -> np.ndarray:
        """Parameters per stage of the cut `stages(k)` (tied copies left out: a lower bound)."""
        if ("params", k) not in self.fb:
            self.fb["params", k] = _stage_totals([u.params for u in self.profile.units], self.stage_ids(k))
        return self.fb["params", k]

    def stage_experts(self, k: int) -> np.ndarray:
        """Routed experts' parameters per stage of the cut `stages(k)` (of stage_params; 0 in a dense model)."""
        if ("experts", k) not in self.fb:
            self.fb["experts", k] = _stage_totals([u.moe.expert_params if u.moe else 0 for u in self.profile.units],
                                                  self.stage_ids(k))
        return self.fb["experts", k]

    def stage_kept(self, k: int, tp: int = 1, sp: bool = False, shard: bool = False) -> np.ndarray:
        """The least saved-for-backward bytes per stage of the cut `stages(k)` with selective recompute, on one
        rank of `tp` (_least_saved), per micro-batch at the profile's batch and dtype (times activation_scale:
        bytes)."""
        key = ("kept", k, tp, sp, shard)
        if key not in self.fb:
            if ("unit kept", tp, sp, shard) not in self.fb:   # every cut's stages sum the same units' figures
                self.fb["unit kept", tp, sp, shard] = [_least_saved(u, self.dtype_ratio, self.cp, tp=tp, sp=sp,
                                                                    shard=shard) for u in self.profile.units]
            self.fb[key] = _stage_totals(self.fb["unit kept", tp, sp, shard], self.stage_ids(k))
        return self.fb[key]

    def rank_kept(self, pt: Point) -> np.ndarray:
        """stage_kept on one of the point's tp ranks, SP's shards saved where an attempt may save them."""
        return self.stage_kept(pt.pp * pt.v, pt.tp, pt.sp, _may_save_shards(pt))

    def stage_inputs(self, k: int) -> np.ndarray:
        """Per stage of the cut `stages(k)`, the inputs of its units that full recompute keeps per micro-batch
        (estimate._stage: each unit's input but the model's own, at the profile's scale: times activation_scale)."""
        if ("inputs", k) not in self.fb:
            units = self.profile.units
            self.fb["inputs", k] = _stage_totals([float(units[i - 1].output_bytes) if i else 0.0
                                                  for i in range(len(units))], self.stage_ids(k))
        return self.fb["inputs", k]

    def alive_kept(self, pt: Point) -> np.ndarray:
        """Per pipeline rank, rank_kept summed over the forwards it runs before its first backward (P6)."""
        key = ("alive", pt.pp, pt.v, pt.schedule, pt.microbatches, pt.tp, pt.sp)
        if key not in self.fb:
            self.fb[key] = _over_alive(pt, self.rank_kept(pt))
        return self.fb[key]

    def act_floors(self, pt: Point, act_scale: float) -> np.ndarray:
        """P8's activation floor per pipeline rank of the point's cut and schedule (search._least_need), in bytes,
        the same for every ZeRO stage and dp of a shape."""
        key = ("floors", pt.pp, pt.v, pt.tp, pt.sp, pt.schedule, pt.microbatches, act_scale)
        if key not in self.fb:
            kept = self.rank_kept(pt)
            least = np.minimum(self.stage_inputs(pt.pp * pt.v), kept)
            if get_spec(pt.schedule).split_backward:   # past the first stage, a recomputed stage keeps what it
                least[1:] = kept[1:]                      # saves (_least_need)
            self.fb[key] = _over_alive(pt, least * act_scale)
        return self.fb[key]

    def stage_fb(self, k: int, mbs: int | None = None) -> np.ndarray:
        """(forward, backward) per stage of the cut `stages(k)`, per micro-batch at the profile's batch, or at `mbs`
        where that is given (at_batch's times; linear without it)."""
        if (k, mbs) not in self.fb:
            b0 = self.profile.micro_batch_size
            if mbs is None or mbs == b0:
                unit_fb = self.unit_fb
            elif self.at_batch is not None:
                if ("at", mbs) not in self.fb:
                    self.fb["at", mbs] = self.at_batch(mbs)
                unit_fb = self.fb["at", mbs]
            else:
                unit_fb = [(f * mbs / b0, b * mbs / b0) for f, b in self.unit_fb]
            self.fb[k, mbs] = _stage_sums(unit_fb, self.stage_ids(k))
        return self.fb[k, mbs]

    def stage_ids(self, k: int) -> tuple[tuple[int, ...], ...]:
        """stages(k) as the units' indices in the profile."""
        if ("ids", k) not in self.fb:
            where = {name: i for i, name in enumerate(self.names)}
            self.fb["ids", k] = tuple(tuple(where[u] for u in st) for st in self.stages(k))
        return self.fb["ids", k]

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
    (cost_models.records.schedule.ScheduleSpec.unsafe says which, and why)."""
    return get_spec(schedule).unsafe(zero, dp) is None


def _strategy(point: Point, stages, *, precision: Precision, optimizer: Optimizer, recompute=(), selective: bool = False,
              shard: bool = False) -> Strategy:
    """The strategy of a point; a point of a context-parallel search is its data view (point.dp = dp x cp)."""
    return Strategy(dp=point.dp // point.cp, cp=point.cp, pp=point.pp, zero=point.zero, schedule=point.schedule, microbatches=point.microbatches,
                    micro_batch_size=point.micro_batch_size, v=point.v, stages=stages, recompute=tuple(recompute),
                    tp=point.tp, sp=point.sp, selective=selective, precision=precision, optimizer=optimizer,
                    distributed_optimizer=point.distributed_optimizer, sp_save_shard=shard, ep=point.ep)


def _states(pt: Point, params: float, experts: float, req: PlanRequest, *, paper: bool = False) -> float:
    """Model-state bytes per rank for `params` parameters of which `experts` are routed experts' (whole, as at
    ep = 1): the dense ones sharded by ZeRO over dp, the experts split ep ways and sharded over the dp / ep ranks
    holding the same experts (cost.moe). As the executor holds them (executor_state_bytes), or with `paper` as the
    ZeRO paper counts them (zero_model_state_bytes, P1's)."""
    dense, expert = _state_rates(pt.dp, pt.ep, _state_zero(pt), req.precision, req.optimizer, paper)
    return dense * (params - experts) + (expert * experts if experts else 0.0)


@functools.lru_cache(maxsize=4096)
def _state_rates(dp: int, ep: int, zero: int, precision: str, optimizer: str, paper: bool) -> tuple[float, float]:
    """_states per dense parameter and per routed expert parameter (both linear in the parameters: the bounds ask
    this of every pipeline rank of tens of thousands of points)."""
    states = zero_model_state_bytes if paper else executor_state_bytes
    return (sum(states(1.0, dp, zero, precision, optimizer)),
            sum(states(1.0 / ep, dp // ep, zero, precision, optimizer)))


def _state_zero(pt: Point) -> int:
    """The ZeRO stage whose model states at rest a point holds: the distributed optimizer holds ZeRO-2's shards
    (its whole parameters and gradients are buffers: _buffer_rate)."""
    return 2 if pt.distributed_optimizer else pt.zero


def _memory_aware_stages(point: Point, profile: ModelProfile, cluster: ClusterProfile, est: Estimate,
                         unit_cost: list[float], *, precision: str, optimizer: str):
    """The exact DP with per-stage memory (in-flight counts from the first estimate's schedule)."""
    # bytes per parameter at rest as the executor holds them (FSDP2 shards ZeRO-2's parameters too)
    per_param = sum(executor_state_bytes(1.0, point.dp, _state_zero(point), precision, optimizer))
    act_scale = activation_scale(profile, micro_batch_size=point.micro_batch_size, precision=precision)
    problem = PartitionProblem(
        costs=tuple(unit_cost), n_stages=point.pp * point.v,
        # every tied parameter a unit uses, wherever the cut puts its owner (an upper bound)
        state_bytes=tuple(held_params(profile, u.name, ()) * per_param for u in profile.units),
        act_bytes=tuple(saved_bytes(profile, u, micro_batch_size=point.micro_batch_size, precision=precision)
                        * act_scale for u in profile.units),
        in_flight=tuple(max(1, st.peak_in_flight) for st in est.stages),
        capacity=(cluster.device.memory_bytes - overhead_bytes(cluster)) / point.v)
    return stages_from_ranges([u.name for u in profile.units], dp_partition(problem))


def _least_saved(u: UnitProfile, dtype_ratio: float, cp: int = 1, *, tp: int = 1, sp: bool = False,
                 shard: bool = False) -> float:
    """The least a unit saves per micro-batch at the profile's scale with selective recompute (the attention core
    dropped), at any micro-batch (memory.saved_at: the fixed part left out, the growing part not in the profile's
    dtype counted at its own size): the pruning bounds' activation term. Under expert parallelism the experts keep
    less at an even load, called with weights that need no gradient (cost.moe.ep_saved_bytes, whose dispatch adds
    more): left out, at any ep. On one of `tp` ranks: split by role as the estimate splits it (memory.tp_saved_bytes;
    the vocabulary taken as split and, under SP, shards as saved where `shard` says an attempt may save them: the
    lesser). Under context parallelism over cp ranks (`u` from its cp_view) selective recompute keeps the keys and
    values gathered from the other cp - 1 ranks too (cost.context_parallel.cp_unit's `kept`)."""
    grow, grow_other, _, _ = saved_parts(u)
    unweighted = (max(0, u.moe.routed_saved_bytes - u.moe.routed_unweighted_bytes)
                  if u.moe and u.moe.routed_unweighted_bytes >= 0 else 0)   # -1: an older profile, as measured
    least = max(0.0, grow + grow_other / dtype_ratio - unweighted)
    gathered = (cp - 1) * u.tp.core_kv_bytes / tp if u.tp else 0
    return max(0.0, tp_saved_bytes(least, u.tp, tp=tp, sp=sp, selective=True, vocab=True, save_shard=shard)) + gathered


def _core_bytes(profile: ModelProfile, *, micro_batch_size: int, precision: str,
                with_shards: bool = False) -> dict[str, float]:
    """Unit -> the attention core's saved bytes per micro-batch before tp divides them (what selective recompute
    drops: memory.tp_saved_bytes), at this micro-batch in the compute dtype; `with_shards`: plus the inputs of
    column-split linears, whole (more than SP saving the shard drops: an upper bound)."""
    scale = activation_scale(profile, micro_batch_size=micro_batch_size, precision=precision)
    return {u.name: ((u.tp.saved_core + (u.tp.saved_col_input if with_shards else 0)) if u.tp else 0) * scale
            for u in profile.units}


def _overflow(est: Estimate, cap: int) -> set[int]:
    """Stages on ranks past the device's capacity."""
    return {sid for m in est.memory_per_rank if m.total_bytes > cap for sid in m.stages}


def _recompute_cannot_help(est: Estimate, cap: int) -> bool:
    """Recompute (selective or full) only shrinks activations: a rank whose memory less all its activations is
    still past the capacity cannot fit by recomputing (provable, no estimate needed)."""
    return any(m.total_bytes - m.activations > cap for m in est.memory_per_rank)


def _selective_may_fit(est: Estimate, profile: ModelProfile, cap: int, *, micro_batch_size: int,
                       precision: str) -> bool:
    """Selective recompute drops the attention core's saved tensors (the units' tp.saved_core) of every
    micro-batch in flight: a rank past the capacity by more than all of those cannot fit with it (no estimate)."""
    core = _core_bytes(profile, micro_batch_size=micro_batch_size, precision=precision)
    by_stage = {st.stage: st for st in est.stages}
    for m in est.memory_per_rank:
        drops = sum(max(1, by_stage[sid].peak_in_flight) * sum(core[u] for u in by_stage[sid].units)
                    for sid in m.stages)
        if m.total_bytes - drops > cap:
            return False
    return True


def _cost_point(point: Point, profile: ModelProfile, cluster: ClusterProfile, parts: _Partitions,
                unit_cost: list[float], *, precision: Precision, optimizer: Optimizer, kth: float = math.inf,
                must: frozenset[int] = frozenset()) -> tuple[list[_Costed], int]:
    """Estimate a point; if it does not fit, retry with selective recompute (the attention core, Korthikanti et
    al. 2022), then full recompute on the stages that still overflow (selective on the rest), then memory-aware
    stages. Returns every estimate made (the last is the best attempt) and how many were made.
    P3: no retry when the first attempt is already no faster than `kth` (the k-th best time so far): recompute
    only adds work, and the memory-aware cut's bottleneck is no less than the balanced one's.
    P6: `must` are stages whose ranks cannot hold one micro-batch even with selective recompute (_must_recompute):
    full recompute there is tried first, and is the answer when it fits (nothing less can); no memory-aware re-cut
    is tried for such a point (P6/P7 count its recompute in its bound, which a re-cut could undercut)."""
    stages = parts.stages(point.pp * point.v)
    n_stages = point.pp * point.v

    def attempt(stages, recompute=(), selective=False, shard=False) -> _Costed:
        strategy = _strategy(point, stages, precision=precision, optimizer=optimizer, recompute=recompute,
                             selective=selective, shard=shard)
        return _Costed(point, strategy, estimate(strategy, profile, cluster, compact=True))

    made = 0
    if must:
        first = attempt(stages, recompute=tuple(i in must for i in range(n_stages)), selective=len(must) < n_stages)
        made = 1
        if first.estimate.fits or first.estimate.step_time_s >= kth:
            return [first], made
        if _may_save_shards(point):
            again = _sharded(attempt, first)
            made += 1
            if again.estimate.fits:
                return [first, again], made
    attempts = [attempt(stages)]
    if attempts[-1].estimate.fits or attempts[-1].estimate.step_time_s >= kth:
        return attempts, made + 1
    attempts += _retries(point, profile, cluster, attempts[0].estimate, unit_cost, attempt, stages,
                         precision=precision, optimizer=optimizer, recut=not must)
    return attempts, made + len(attempts)


def _may_save_shards(point: Point) -> bool:
    """SP may save its gathered inputs as shards (Strategy.sp_save_shard): not under a split backward."""
    return point.sp and not get_spec(point.schedule).split_backward


def _sharded(attempt, a: _Costed) -> _Costed:
    """`a`'s strategy again, saving SP's shards: fewer bytes, an all-gather more per region in backward."""
    s = a.strategy
    return attempt(s.stages, recompute=s.recompute, selective=s.selective, shard=True)


def _retries(point: Point, profile: ModelProfile, cluster: ClusterProfile, first: Estimate, unit_cost: list[float],
             attempt, stages, *, precision: Precision, optimizer: Optimizer, recut: bool = True) -> list[_Costed]:
    """_cost_point's retries after a first estimate that does not fit; the last one made is the best attempt.
    Under SP, saving shards is tried beside selective recompute (neither is free: a gather per region, or the
    attention core again) and the faster that fits is kept; with recompute it is tried where recompute alone does
    not fit."""
    n_stages, cap = point.pp * point.v, cluster.device.memory_bytes
    precision = _executed(precision, cluster.device.kind)   # the bytes the ranks hold (_as_run)
    out: list[_Costed] = []
    shards = _may_save_shards(point)
    if not _recompute_cannot_help(first, cap):
        sel = None
        if shards:
            out.append(attempt(stages, shard=True))
        if _selective_may_fit(first, profile, cap, micro_batch_size=point.micro_batch_size, precision=precision):
            sel = attempt(stages, selective=True)
            out.append(sel)
            if shards and not sel.estimate.fits and not out[0].estimate.fits:
                out.append(_sharded(attempt, sel))
        fitting = [a for a in out if a.estimate.fits]
        if fitting:
            best = min(fitting, key=lambda a: a.estimate.step_time_s)
            out.remove(best)
            return out + [best]
        over = _overflow(sel.estimate if sel else first, cap)
        out.append(attempt(stages, recompute=tuple(i in over for i in range(n_stages)), selective=len(over) < n_stages))
        if not out[-1].estimate.fits and shards:
            out.append(_sharded(attempt, out[-1]))
        if out[-1].estimate.fits:
            return out
    if n_stages == 1 or not recut:
        return out
    try:
        stages = _memory_aware_stages(point, profile, cluster, first, unit_cost, precision=precision,
                                      optimizer=optimizer)
    except PartitionInfeasible:
        return out
    if _strategy(point, stages, precision=precision, optimizer=optimizer).split_tie(sp.units for sp in profile.shared):
        return out   # the new cut put a tie's stages on one rank
    out.append(attempt(stages))
    return out


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
    min_need: float                  # the least bytes a point P8 dropped needs (model states, activations, overhead)
    unit_cost: list[float]
    gpus: int                        # the GPU count searched (the request's, or the cluster's)
    tp: TPOptions = field(default_factory=TPOptions)   # the (tp, sp) searched, and why others were not
    pruned_tp_bounds: dict[int, float] = field(default_factory=dict)   # tp -> least bound among points P2 pruned
    pruned_ep_bounds: dict[int, float] = field(default_factory=dict)   # the same per ep
    pruned_cp_bounds: dict[int, float] = field(default_factory=dict)   # the same per cp
    cp_degrees: tuple[int, ...] = (1,)                                  # the context-parallel degrees searched
    unit_costs: dict[int, list[float]] = field(default_factory=dict)   # cp -> unit_cost on its view (provenance)


def search_tp(profile: ModelProfile, cluster: ClusterProfile, gpus: int, req: PlanRequest) -> TPOptions:
    """The (tp, sp) pairs this model admits on this cluster's nodes (planner.space.tp_options)."""
    return tp_options(profile.tensor_parallel, devices_per_node=cluster.devices_per_node, gpus=gpus,
                      seq_len=profile.seq_len, degrees=req.tp_degrees)


def _points(profile: ModelProfile, gpus: int, req: PlanRequest, parts: "_Partitions",
            tp: TPOptions = TPOptions(), *, gpu: bool = False, cp: int = 1) -> list[Point]:
    """The space (planner.space) less what the executor cannot run and what the request narrows away; `gpu`: the
    distributed optimizer too (on CPU ranks, where every plan runs fp32, it saves nothing). `cp` > 1: the points of
    context parallelism's data view (`profile` is cp_view's, the request's batch cp times the sequences): those
    whose data ranks group into CP groups, without expert parallelism; [] where there are none."""
    if cp > 1:
        view = replace(req, global_batch_size=req.global_batch_size * cp, ep_degrees=(1,))
        try:
            points = _points(profile, gpus, view, parts, tp, gpu=gpu)
        except ConfigError:
            return []
        return [replace(pt, cp=cp) for pt in points if pt.dp % cp == 0]
    n_units = len(profile.units)
    ties = tuple(sp.units for sp in profile.shared)
    pipelines = profile.pipeline_refusal is None
    for ep in req.ep_degrees or ():
        why = check_ep(profile, ep) or (None if ep in ep_degrees(profile.experts) else
                                        f"--ep {ep} is not a power of two dividing the {profile.experts} experts")
        if why:
            raise ConfigError(why)
    points = [pt for pt in enumerate_points(gpus=gpus, global_batch=req.global_batch_size, n_units=n_units,
                                            pipelines=pipelines, tp_pairs=tp.pairs, sp_pipelines=tp.sp_pipelines,
                                            eps=ep_degrees(profile.experts, degrees=req.ep_degrees),
                                            distributed_optimizer=gpu)
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
    raise ConfigError(f"no (dp, pp, tp) split of {gpus} devices divides the global batch {req.global_batch_size}; "
                      f"use a batch divisible by the data-parallel degree")


def _splits_tie(pt: Point, parts: "_Partitions", ties, req: PlanRequest) -> bool:
    """The schedule cannot train a tied parameter whose stages share a rank (ScheduleSpec.same_rank_tie)."""
    if pt.pp == 1 or not ties or not get_spec(pt.schedule).same_rank_tie:
        return False
    return _strategy(pt, parts.stages(pt.pp * pt.v), precision=req.precision, optimizer=req.optimizer).split_tie(ties) is not None


def _one_microbatch_schedule(pp: int) -> str | None:
    """A schedule of the registry that runs pp one-chunk stages on one micro-batch without split backward (the
    per-unit proxy strategy's, _UnitTimes: one unit per stage)."""
    for name, spec in SCHEDULES.items():
        if not spec.split_backward and 1 in spec.searched_v:
            try:
                spec.check(pp, 1, 1)
            except ConfigError:
                continue
            return name
    return None


class _UnitTimes:
    """Per-unit (forward, backward) seconds of one micro-batch on one TP rank as the estimate prices them in its
    stages (estimate.unit_costs, the function the estimate's stages sum: compute share, narrow-GEMM efficiency,
    exposed TP collectives and, under context parallelism, the key/value gathers and their gradients'
    reduce-scatters), per (tp, sp, micro-batch size), for a strategy that puts every unit in its own stage and runs
    one micro-batch. Each size is priced, not scaled from another: a GPU profile's in-model gap is a fixed
    cost per call (compute._in_model), so per-sample time can grow with the batch. On clusters without a compute
    probe (presets), where unit times do not depend on how many ranks run, and under expert parallelism on GPUs
    (whose taller expert products can run faster than the profile's); None elsewhere (the bound falls back to the
    profile's unit times / tp, which EP on CPU ranks only lengthens: imbalance >= 1, all-to-alls added)."""

    def __init__(self, profile: ModelProfile, cluster: ClusterProfile, req: PlanRequest, cp: int = 1) -> None:
        self.profile, self.cluster, self.req, self.cp = profile, cluster, req, cp
        self.names = [u.name for u in profile.units]
        self.cache: dict[tuple[int, bool, int, int], list[tuple[float, float]] | None] = {}
        self.stage_cache: dict[tuple, np.ndarray] = {}

    def units(self, tp: int, sp: bool, mbs: int, ep: int = 1) -> list[tuple[float, float]] | None:
        if (tp, sp, mbs, ep) not in self.cache:
            # expert parallelism can make a unit faster on GPUs (taller expert products: estimate._ep_unit), where
            # a probed cluster's unit times do not depend on the ranks running either: priced as the estimate does
            priced = self.cluster.compute is None or (ep > 1 and self.cluster.device.kind == "gpu")
            self.cache[tp, sp, mbs, ep] = self._measure(tp, sp, mbs, ep) if priced else None
        return self.cache[tp, sp, mbs, ep]

    def _measure(self, tp: int, sp: bool, mbs: int, ep: int) -> list[tuple[float, float]] | None:
        n, schedule = len(self.names), _one_microbatch_schedule(len(self.names))
        if schedule is None:
            return None
        # under expert parallelism a unit's cost holds its all-to-alls and the busiest rank's routed work at EP
        # shapes (estimate._ep_unit), which the dp degree does not change: dp = ep stands for every dp
        s = Strategy(dp=ep, pp=n, zero=0, schedule=schedule, microbatches=1, micro_batch_size=mbs,
                     stages=tuple((u,) for u in self.names), tp=tp, sp=sp, precision=self.req.precision,
                     optimizer=self.req.optimizer, ep=ep)
        return unit_costs(s, self.profile, self.cluster, cp=self.cp)

    def stage_fb(self, pt: Point, parts: _Partitions) -> np.ndarray | None:
        """(forward, backward) per stage of the point's cut, per micro-batch of its size (None: no proxy)."""
        k = pt.pp * pt.v
        key = (k, pt.tp, pt.sp, pt.micro_batch_size, pt.ep)
        if key not in self.stage_cache:
            per_unit = self.units(pt.tp, pt.sp, pt.micro_batch_size, pt.ep)
            if per_unit is None or k == 1 and len(self.names) == 1:
                return None
            self.stage_cache[key] = _stage_sums(per_unit, parts.stage_ids(k))
        return self.stage_cache[key]


class _Ranks(NamedTuple):
    """P2's and P6's figures of one shape, an array over its pipeline ranks each: `start_busy` = when micro-batch
    0's forward can first reach the rank + its work for all micro-batches; `tail` = the backward the stages ahead
    still run after its last action; `params` = the parameters its stages hold, divided by tp (at best); `forward`
    the forward part of its work (what full recompute runs again); `held` its stages (ranks x v); `alive` the least
    activation bytes it keeps with selective recompute (P6), at the profile's micro-batch, on one tp rank;
    `experts` of params, the routed experts' (whole: split ep ways where the point says). Arrays, not a record
    per rank: the search bounds thousands of shapes of up to 128 ranks on large clusters, and an operation on a
    whole array is one call where a loop over the ranks is one per rank."""

    start_busy: np.ndarray
    tail: np.ndarray
    params: np.ndarray
    forward: np.ndarray
    held: np.ndarray
    alive: np.ndarray
    experts: np.ndarray

    def recomputing(self, stages: frozenset[int]) -> "_Ranks":
        """These ranks with full recompute on `stages`: a rank holding any of them runs its forward twice (P6)."""
        rerun = np.isin(self.held, tuple(stages)).any(axis=1)
        return _Ranks(np.where(rerun, self.start_busy + self.forward, self.start_busy), *self[1:])


def _schedule_bound(pt: Point, parts: _Partitions, times: _UnitTimes | None = None) -> _Ranks:
    """P2 per pipeline rank, for the point's stage cut (stage times scaled to its micro-batch and tp; no p2p,
    recompute or per-action overheads). Pipeline rank j holds stages whose work it must do for all m
    micro-batches, and cannot start before micro-batch 0's forward has passed the stages ahead of its first one;
    without split backward its last action is that first stage's backward, which the stages ahead must still run
    backward (for any v). One stage: m x (forward + backward)."""
    k = pt.pp * pt.v
    fb = times.stage_fb(pt, parts) if times is not None else None
    scale = 1.0
    if fb is None:   # the profile's unit times at this micro-batch / tp: narrower GEMMs are no faster per FLOP
        # (measured times are affine in the micro-batch, not linear: scaling them linearly could exceed the
        # estimate above the profile's micro-batch, where the fixed part stays whole)
        scale = 1.0 / pt.tp
        fb = parts.stage_fb(k, pt.micro_batch_size)
    params, kept, experts = parts.stage_params(k), parts.rank_kept(pt), parts.stage_experts(k)
    m, f, work = pt.microbatches, fb[:, 0], fb[:, 0] + fb[:, 1]
    if k == 1:
        return _Ranks(start_busy=m * work * scale, tail=np.zeros(1), params=params / pt.tp, forward=m * f * scale,
                      held=np.zeros((1, 1), dtype=int), alive=kept, experts=experts)
    held = _placement(pt.schedule, pt.pp, pt.v)
    first = held[:, 0]   # placement's stages are ascending
    # np.cumsum adds one stage at a time, in stage order; a rank's v <= 4 stages (searched_v) sum left to right
    # too (numpy's sum pairs terms only from 8 on)
    f_before = np.concatenate(([0.0], np.cumsum(f)))[first]
    tail = (np.zeros(pt.pp) if get_spec(pt.schedule).split_backward
            else np.concatenate(([0.0], np.cumsum(fb[:, 1])))[first] * scale)
    busy, fwd = m * work[held].sum(axis=1), m * f[held].sum(axis=1)
    # P6's activations: the forwards each rank runs before its first backward, all alive at once (1F1B's rank j
    # holds p - j micro-batches then), and at least one micro-batch of its largest stage
    alive = np.maximum(kept[held].max(axis=1), parts.alive_kept(pt))
    return _Ranks(start_busy=(f_before + busy) * scale, tail=tail, params=params[held].sum(axis=1) / pt.tp,
                  forward=fwd * scale, held=held, alive=alive, experts=experts[held].sum(axis=1))


@functools.lru_cache(maxsize=1024)
def _placement(schedule: str, p: int, v: int) -> np.ndarray:
    """schedule.placement as a (p, v) array, read-only."""
    return _frozen(placement(schedule, p, v), dtype=int)


def _stage_totals(per_unit: Sequence[float], ids: Sequence[Sequence[int]]) -> np.ndarray:
    """Per stage of units `ids` (indices into `per_unit`), the sum of its units' values, read-only, each summed one
    unit at a time in unit order (np.sum may pair terms and round otherwise)."""
    return _frozen([float(sum([per_unit[i] for i in st])) for st in ids])


def _stage_sums(per_unit: Sequence[tuple[float, float]], ids: Sequence[Sequence[int]]) -> np.ndarray:
    """(forward, backward) per stage of units `ids`, as a (stages, 2) array (_stage_totals of each)."""
    out = np.column_stack((_stage_totals([f for f, _ in per_unit], ids), _stage_totals([b for _, b in per_unit], ids)))
    out.flags.writeable = False
    return out


def _frozen(values, dtype=float) -> np.ndarray:
    """A read-only array of `values`: the search's caches hand the same one to every point of a shape."""
    out = np.array(values, dtype=dtype)
    out.flags.writeable = False
    return out


def _dp_bound(pt: Point, params: float, cluster: ClusterProfile, req: PlanRequest) -> float:
    """The least exposed data-parallel time of a rank holding `params` (P2'): in a pipeline every stage's
    collectives add to its rank's time, after its last backward or, ZeRO-2/3's gathers, inside its schedule
    (ZeRO-0/1 all-reduce the gradients, ZeRO-1 broadcasts the updated parameters too; ZeRO-2/3 reduce-scatter and
    gather, ZeRO-3 for forward and again for backward, m + 1 >= 2 times); without one, only ZeRO-1's broadcasts
    are known to be exposed. One collective of the whole size is taken for per-tensor ones (a collective's time
    grows no faster than its size: alpha + size x beta). The dp group spans devices_per_node / tp ranks per node,
    as cost_models.cost.estimate places it."""
    if pt.dp == 1 or (pt.pp == 1 and pt.zero != 1) or pt.distributed_optimizer:   # the latter: hidden at best
        return 0.0
    p_b, g_b, _ = BYTES_PER_PARAM[(req.precision, req.optimizer)]
    rpn = group_ranks_per_node(cluster, n=pt.dp, stride=pt.tp)

    def coll(op: str, size: float) -> float:   # the lesser of the two fits (CollectiveFit.predict): a bound
        return min(collective_time(cluster, op, size, pt.dp, ranks_per_node=rpn, back_to_back=b)
                   for b in (False, True))

    if pt.zero <= 1:   # ZeroRedundancyOptimizer's updated parameters go out as broadcasts (estimate)
        bcast = coll("broadcast", params * p_b) if pt.zero == 1 else 0.0
        # the estimate's all-reduce is the lesser of NCCL's ring and tree (comm.collective_time)
        return bcast if pt.pp == 1 else coll("all_reduce", params * g_b) + bcast
    gather = coll("all_gather", params * p_b)
    return coll("reduce_scatter", params * g_b) + (2 if pt.zero == 3 else 1) * gather


def _point_bound(pt: Point, ranks: _Ranks, profile: ModelProfile, cluster: ClusterProfile,
                 req: PlanRequest, memo: dict | None = None) -> float:
    """P2 for one point: every rank ends after its work and its exposed data-parallel collectives, and the step
    after the last backward; then the optimizer step of the fullest rank. Two ranks (the schedule's critical one
    and the busiest) stand for all: any rank's sum is a lower bound. `memo` keeps _dp_bound's answers across
    points (it depends only on dp, pp, ZeRO, tp and the parameters) and the ranks' summary per ranks tuple (the
    caller keeps those alive, so their ids stay theirs)."""
    memo = {} if memo is None else memo
    if ("ranks", id(ranks)) not in memo:
        end = ranks.start_busy + ranks.tail
        memo["ranks", id(ranks)] = (float(end.max()), int(ranks.start_busy.argmax()), int(end.argmax()),
                                    int((ranks.params - ranks.experts + ranks.experts / pt.ep).argmax()))
    schedule, busiest, critical, fullest = memo["ranks", id(ranks)]
    cal = _calibration(cluster)

    def group_time(p: Point, params: float) -> float:
        key = (p.dp, p.pp, p.zero, p.tp, params, p.distributed_optimizer)
        if key not in memo:
            memo[key] = _dp_bound(p, params, cluster, req) * cal.dp_comm_scale
        return memo[key]

    experts_pt = replace(pt, dp=pt.dp // pt.ep, tp=pt.tp * pt.ep, ep=1) if pt.ep > 1 else None

    def dp_time(j: int) -> float:
        """Rank j's: the dense parameters' over dp, and under EP the experts' share over their own group (dp / ep
        ranks, ep x tp apart: placed as _dp_bound places a group of that stride)."""
        params, experts = float(ranks.params[j]), float(ranks.experts[j])
        if experts_pt is None:
            return group_time(pt, params)
        dense = group_time(pt, params - experts)
        return dense + (group_time(experts_pt, experts / pt.ep) if experts_pt.dp > 1 else 0.0)

    start = ranks.start_busy
    bound = max(schedule, float(start[busiest]) + dp_time(busiest), float(start[critical]) + dp_time(critical))
    dense_dp, expert_dp = (pt.dp, pt.dp // pt.ep) if pt.zero >= 1 else (1, 1)
    held = (float(ranks.params[fullest] - ranks.experts[fullest]) / dense_dp
            + float(ranks.experts[fullest]) / pt.ep / expert_dp)
    busy = busy_ranks(cast(Strategy, pt))   # busy_ranks reads only fields a Point has too
    # the update alone, its fixed cost per tensor left out (a lower bound)
    return bound + optimizer_seconds(held, 0.0, profile=profile, cluster=cluster, precision=req.precision,
                                     optimizer=req.optimizer, ranks_running=busy, dtensors=False)


@dataclass
class _Bounds:
    survivors: list[tuple[float, Point]]   # (bound, point), least first
    pruned: int                            # by P1 and P8 (also at a point's turn: floored)
    min_state: float                       # the least model-state bytes any point needs
    memory_limited: tuple[float, Point] | None   # the least time bound, memory aside, of a point P1, P5 or P8 hit
    min_need: float = math.inf             # the least bytes a point P8 dropped needs (states, activations, overhead)
    must: dict[Point, frozenset[int]] = field(default_factory=dict)   # P6: stages that must recompute fully
    # P8 at a point's turn, where P7 finds its stages: each shape's rank bounds and each micro-batch's scale
    ranks: dict[tuple, "_Ranks"] = field(default_factory=dict)
    scales: dict[int, float] = field(default_factory=dict)

    def floored(self, bound: float, pt: Point, need: float) -> None:
        """P8 dropped `pt` (time bound `bound` memory aside), which needs at least `need` bytes."""
        self.pruned += 1
        self.min_need = min(self.min_need, need)
        self.note_limited(bound, pt)

    def note_limited(self, bound: float, pt: Point) -> None:
        """A point memory keeps out, with its time bound memory aside: memory_limited keeps the least."""
        if self.memory_limited is None or bound < self.memory_limited[0]:
            self.memory_limited = (bound, pt)


def _must_recompute(pt: Point, ranks: _Ranks, states: np.ndarray, act_scale: float, room: float) -> frozenset[int]:
    """P6: the stages of pipeline ranks that cannot hold their model states (as the executor keeps them, tp
    dividing every parameter at best) plus their least activations with the attention core dropped (selective
    recompute; _Ranks.alive, on one tp rank), in `room` (the device less the per-process overhead): on the
    balanced cut they fit, if at all, only with full recompute. `states`: _rank_states."""
    over = states + ranks.alive * act_scale > room
    return frozenset(ranks.held[over].ravel().tolist()) if over.any() else frozenset()


def _rank_states(pt: Point, ranks: _Ranks, req: PlanRequest) -> np.ndarray:
    """_states of each pipeline rank's parameters, from the per-parameter rates once (P6 and P8 ask it of every
    rank of tens of thousands of points), and the whole parameters and gradients ZeRO-2 / 3 hold beside them
    (memory.comm_buffer_bytes: a pipeline's FSDP2 stages, and the distributed optimizer, hold them through the step;
    one stage's ZeRO-2 its parameters; its largest unit's left out), of the dense parameters only."""
    dense, expert = _state_rates(pt.dp, pt.ep, _state_zero(pt), req.precision, req.optimizer, False)
    dense += _buffer_rate(pt, req)
    return dense * (ranks.params - ranks.experts) + expert * ranks.experts


def _buffer_rate(pt: Point, req: PlanRequest) -> float:
    """memory.comm_buffer_bytes per parameter of a rank's stages, its largest unit's share left out (a bound)."""
    p_b, g_b, _ = BYTES_PER_PARAM[(req.precision, req.optimizer)]
    return comm_buffer_bytes(stage_params=1.0, largest_unit_params=0.0, zero=_state_zero(pt), pp=pt.pp, dp=pt.dp,
                             param_bytes=p_b, grad_bytes=g_b, held_whole=pt.distributed_optimizer)


def _least_need(pt: Point, states: np.ndarray, parts: "_Partitions", act_scale: float) -> float:
    """P8: the most bytes any pipeline rank needs under every attempt on this cut: its model states (tp dividing
    every parameter at best) and, per forward it runs before its first backward (one for a single stage), the least
    its stage keeps. Full recompute keeps a stage's unit inputs (estimate._stage), except under a split backward
    past the first stage, where a recomputed stage keeps what it saves (estimate._stage's bound); anything else
    keeps at least the selective floor on one tp rank (P6's). More than the room: no attempt fits. `states`:
    _rank_states."""
    return float((states + parts.act_floors(pt, act_scale)).max())


def _over_alive(pt: Point, per_stage: np.ndarray) -> np.ndarray:
    """Per pipeline rank, `per_stage` summed over the forwards it runs before its first backward (one stage: one),
    as each held stage's value times its forwards: the per-forward sum up to its last bit."""
    if pt.pp * pt.v == 1:
        return per_stage[:1]
    held = _placement(pt.schedule, pt.pp, pt.v)
    return (per_stage[held] * _alive_before_backward(pt.schedule, pt.pp, pt.microbatches, pt.v)).sum(axis=1)


@functools.lru_cache(maxsize=4096)
def _alive_before_backward(schedule: str, p: int, m: int, v: int) -> np.ndarray:
    """Per pipeline rank and stage it holds (_placement's (p, v)), how many of the forwards the rank runs before its
    first backward (schedule.forwards_before_backward) are on that stage. P6 and P8 ask it of thousands of points
    of few shapes; GPipe's rank runs m x v forwards before its first backward, on v stages."""
    held = placement(schedule, p, v)
    counts = [collections.Counter(forwards_before_backward(schedule, j, p, m, v)) for j in range(p)]
    return _frozen([[counts[j][st] for st in held[j]] for j in range(p)])


def _bounded(points: list[Point], profile: ModelProfile, cluster: ClusterProfile, parts: "_Partitions",
             req: PlanRequest) -> _Bounds:
    """P1 (module doc) drops points whose model states cannot fit; the rest get P2's time bound (P5's recompute
    added where it must run), least first."""
    largest_unit = max(u.params for u in profile.units)
    overhead, cap = overhead_bytes(cluster), cluster.device.memory_bytes
    out = _Bounds(survivors=[], pruned=0, min_state=math.inf, memory_limited=None)
    # the schedule's part is the same for every ZeRO stage (keyed by group, and by (group, P6's stages))
    group_bound: dict[tuple, _Ranks] = {}
    memo: dict = {}
    # one micro-batch's activations with selective recompute (the attention core dropped), all divided by tp at
    # best: the least a stage holds without full recompute (P5)
    kept = sum(_least_saved(u, dtype_ratio(profile, req.precision), parts.cp) for u in profile.units)
    scales = {mbs: activation_scale(profile, micro_batch_size=mbs, precision=req.precision)
              for mbs in {pt.micro_batch_size for pt in points}}
    acts = {mbs: kept * scale for mbs, scale in scales.items()}
    times = _UnitTimes(profile, cluster, req, cp=points[0].cp) if points else None
    all_experts = sum(u.moe.expert_params if u.moe else 0 for u in profile.units)
    largest = max(profile.units, key=lambda u: u.params)
    for pt in points:
        # tensor parallelism divides at most every parameter by tp (norms and whole embeddings stay replicated)
        held = max(profile.total_params / pt.pp, largest_unit) / pt.tp
        state = sum(zero_model_state_bytes(held, pt.dp, _state_zero(pt), req.precision, req.optimizer)) + overhead
        if pt.ep > 1:   # the routed experts split ep ways: the average stage's states, or the largest unit's
            state = overhead + max(
                _states(pt, profile.total_params / pt.pp, all_experts / pt.pp, req, paper=True),
                _states(pt, largest.params, largest.moe.expert_params if largest.moe else 0, req, paper=True)) / pt.tp
        out.min_state = min(out.min_state, state)
        g = _shape(pt)
        if g not in group_bound:
            group_bound[g] = _schedule_bound(pt, parts, times)
        bound = _point_bound(pt, group_bound[g], profile, cluster, req, memo)
        limited = state > cap                                  # P1
        if not limited and pt.pp * pt.v == 1 and state + acts[pt.micro_batch_size] / pt.tp > cap:
            limited = True                                     # P5: one stage that fits only by full recompute
            bound, memory_free = bound + float(group_bound[g].forward[0]), bound
        else:
            memory_free = bound
        if limited:
            out.note_limited(memory_free, pt)
        if state > cap:
            out.pruned += 1
            continue
        must = _must_recompute(pt, group_bound[g], states := _rank_states(pt, group_bound[g], req),   # P6's, P8's
                               scales[pt.micro_batch_size], cap - overhead)
        need = (_least_need(pt, states, parts, scales[pt.micro_batch_size])
                if req.prune and (must or pt.pp * pt.v == 1) else 0.0)
        if need > cap - overhead:                              # P8
            out.floored(memory_free, pt, need + overhead)
            continue
        if must and pt.pp * pt.v > 1:   # P6: those ranks run their forward twice
            out.must[pt] = must
            if (g, must) not in group_bound:
                group_bound[g, must] = group_bound[g].recomputing(must)
            bound = max(bound, _point_bound(pt, group_bound[g, must], profile, cluster, req, memo))
        out.survivors.append((bound, pt))
    out.survivors.sort(key=lambda x: x[0])
    out.ranks, out.scales = group_bound, scales
    return out


def _shape(pt: Point) -> tuple:
    """Points that differ only in ZeRO stage: the same stages, schedule, micro-batches and expert parallelism, so
    the same unit times and schedule bound."""
    return pt.tp, pt.sp, pt.pp, pt.v, pt.schedule, pt.micro_batch_size, pt.ep


def _group(pt: Point) -> tuple:
    """Points of one shape that share the pipeline makespan (P4): ZeRO-0 and 1 (the estimate adds their
    data-parallel collectives and the optimizer after the simulated schedule); sharded ZeRO-2 and 3 each on their
    own, as a pipeline's FSDP gathers can sit inside its schedule (estimate._stage_gather) and lengthen it; the
    distributed optimizer on its own too (FSDP2 casts for it: no autocast, other unit times)."""
    return _shape(pt), pt.zero if pt.dp > 1 and pt.zero >= 2 else 0, pt.distributed_optimizer


def _makespan(est: Estimate) -> float:
    """The simulated schedule's length without data-parallel collectives or optimizer: a lower bound on the step
    time of every point of the group (P4), whatever its ZeRO stage or recompute."""
    b = est.breakdown
    return min(est.step_time_s, b.compute_s + b.bubble_s + b.p2p_s)


class _Frontier:
    """Survivors by lower bound, least first (a heap). A group's bound rises to the makespan learnt from its costed
    members (P4): a member whose estimate recomputed stages S bounds every member that must recompute S or more
    (P6; more recompute only lengthens each action, so the schedule); a point whose bound rose is pushed back, not
    costed out of order."""

    def __init__(self, bounded: list[tuple[float, Point]], must: dict[Point, frozenset[int]]) -> None:
        self.heap = [(bound, i, pt) for i, (bound, pt) in enumerate(bounded)]
        heapq.heapify(self.heap)
        self.must = must
        self.floors: dict[tuple, dict[frozenset[int], float]] = {}
        self.plain: dict[tuple, Estimate] = {}   # group -> a member's estimate without recompute (P7)
        self.order = itertools.count(len(self.heap))   # tie-breaks for points pushed back

    def learn(self, pt: Point, c: _Costed) -> None:
        rec = frozenset(i for i, r in enumerate(c.strategy.recompute) if r)
        if not rec and not c.strategy.selective:
            self.plain.setdefault(_group(pt), c.estimate)
        if rec and rec != self.must.get(pt):
            return   # recompute chosen from this point's own overflow: no bound on the others
        known = self.floors.setdefault(_group(pt), {})
        known[rec] = max(known.get(rec, 0.0), _makespan(c.estimate))

    def floor(self, pt: Point) -> float:
        must = self.must.get(pt, frozenset())
        return max((v for rec, v in self.floors.get(_group(pt), {}).items() if rec <= must), default=0.0)

    def peek(self) -> float:
        """The least bound left (raised to its group's floor first, as pop would), inf when empty."""
        while self.heap:
            bound, i, pt = self.heap[0]
            floor = self.floor(pt)
            if floor <= bound:
                return bound
            heapq.heapreplace(self.heap, (floor, i, pt))
        return math.inf

    def pop(self) -> tuple[float, Point] | None:
        while self.heap:
            bound, i, pt = heapq.heappop(self.heap)
            floor = self.floor(pt)
            if floor > bound:
                heapq.heappush(self.heap, (floor, i, pt))
                continue
            return bound, pt
        return None

    def rest(self) -> list[tuple[float, Point]]:
        """What was never costed, least bound first (emptied)."""
        out = sorted(((max(b, self.floor(pt)), i, pt) for b, i, pt in self.heap))
        self.heap = []
        return [(b, pt) for b, _, pt in out]


def _known_overflow(pt: Point, plain: Estimate | None, parts: _Partitions, profile: ModelProfile, room: float,
                    req: PlanRequest) -> frozenset[int]:
    """P7: stages that must recompute fully, read off another ZeRO stage's estimate of the same group (the same
    stages and schedule: the same activations in flight): a rank whose model states under this ZeRO stage (tp
    dividing every parameter at best) plus those activations, less every attention core selective recompute could
    drop, pass `room` (the device less the overhead) cannot fit without full recompute."""
    if plain is None:
        return frozenset()
    k = pt.pp * pt.v
    params, experts = parts.stage_params(k), parts.stage_experts(k)
    core = _core_bytes(profile, micro_batch_size=pt.micro_batch_size, precision=req.precision, with_shards=pt.sp)
    by_stage = {st.stage: st for st in plain.stages}
    out: set[int] = set()
    for m in plain.memory_per_rank:
        held = sum(params[sid] for sid in m.stages) / pt.tp
        drops = sum(max(1, by_stage[sid].peak_in_flight) * sum(core[u] for u in by_stage[sid].units)
                    for sid in m.stages)
        states = _states(pt, held, sum(experts[sid] for sid in m.stages), req)
        if states + m.activations - drops > room:
            out.update(m.stages)
    return frozenset(out)


def _memory_limited(bounds: _Bounds, times: list[float], profile: ModelProfile, cluster: ClusterProfile,
                    parts: _Partitions, req: PlanRequest) -> _Costed | None:
    """The point memory kept out (P1, P5, P8) that could have been fastest, estimated as it is: the rationale's
    "memory binds" compares the winner with it. None when none could beat the winner or it fits."""
    if bounds.memory_limited is None or not times or bounds.memory_limited[0] >= times[0]:
        return None
    pt = bounds.memory_limited[1]
    strategy = _strategy(pt, parts.stages(pt.pp * pt.v), precision=req.precision, optimizer=req.optimizer)
    est = estimate(strategy, profile, cluster, compact=True)
    return None if est.fits else _Costed(pt, strategy, est)


def _kth(times: list[float], k: int) -> float:
    """The k-th least of `times` (a sorted list), inf when there are fewer."""
    return times[k - 1] if len(times) >= k else math.inf


@dataclass
class _Degree:
    """One context-parallel degree's search: its profile (cp_view's for cp > 1), cut, points, bounds and frontier,
    and what costing them found."""
    cp: int
    profile: ModelProfile
    parts: _Partitions
    tp: TPOptions
    points: list[Point]
    bounds: _Bounds
    frontier: _Frontier
    feasible: list[_Costed] = field(default_factory=list)
    infeasible: list[_Costed] = field(default_factory=list)
    costed: int = 0


def _branch_and_bound(degrees: list[_Degree], cluster: ClusterProfile, req: PlanRequest,
                      on_progress: ProgressFn | None) -> list[float]:
    """Cost points least bound first, over every context-parallel degree's frontier at once, until none left can
    enter the top k (module doc); each degree keeps its feasible and infeasible attempts and its estimate count.
    Returns the feasible step times, sorted; what is left in the frontiers was pruned."""
    overhead = overhead_bytes(cluster)
    room = cluster.device.memory_bytes - overhead
    run = _as_run(req, cluster)
    times: list[float] = []
    total, done = sum(len(d.bounds.survivors) for d in degrees), 0
    while (item := (d := min(degrees, key=lambda one: one.frontier.peek())).frontier.pop()) is not None:
        if on_progress and done % 25 == 0:
            on_progress(done, total)
        bound, pt = item
        kth = _kth(times, req.top_k) if req.prune else math.inf
        if bound >= kth:                                       # P2 / P4: nothing left can enter the top k
            d.frontier.heap.append((bound, -1, pt))
            break
        # P6 / P7 are shortcuts of the search: an exhaustive one (prune=False) costs every point the plain way
        must = (d.bounds.must.get(pt, frozenset()) | _known_overflow(
            pt, d.frontier.plain.get(_group(pt)), d.parts, d.profile, room, run)) if req.prune else frozenset()
        d.frontier.must[pt] = must
        if must and not d.bounds.must.get(pt):                 # P8 on P7's stages: no attempt fits
            states = _rank_states(pt, d.bounds.ranks[_shape(pt)], run)
            need = _least_need(pt, states, d.parts, d.bounds.scales[pt.micro_batch_size])
            if need > room:
                d.bounds.floored(bound, pt, need + overhead)
                continue
        if d.frontier.floor(pt) > bound:                       # P7 raised its bound: back in line
            heapq.heappush(d.frontier.heap, (d.frontier.floor(pt), next(d.frontier.order), pt))
            continue
        done += 1
        attempts, n = _cost_point(pt, d.profile, cluster, d.parts, d.parts.unit_cost, precision=req.precision,
                                  optimizer=req.optimizer, kth=kth, must=must)
        d.costed += n
        d.frontier.learn(pt, attempts[0])
        best = attempts[-1]
        (d.feasible if best.estimate.fits else d.infeasible).append(best)
        if best.estimate.fits:
            bisect.insort(times, best.estimate.step_time_s)
        if not best.estimate.fits or len(attempts) > 1:
            d.infeasible.append(attempts[0])  # the unconstrained version, for "memory binds" in the rationale
    if on_progress:
        on_progress(total, total)
    return times


def bound_unit_times(profile: ModelProfile, cluster: ClusterProfile, req: PlanRequest,
                     micro_batch_size: int) -> list[tuple[float, float]]:
    """Each unit's (forward, backward) of one micro-batch as the estimate prices a unit without tensor parallelism
    (estimate.unit_seconds, its calibration included), with one rank computing: no plan's units run faster
    (sharing.busy_ranks >= 1), so the bounds built on them stay lower bounds; mixed precision's factor only where
    it makes units faster, for the same reason."""
    return [unit_seconds(u, profile, cluster, micro_batch_size=micro_batch_size, precision=req.precision,
                         ranks_running=1, mixed=profile.mixed_factor < 1) for u in profile.units]


def _executed(precision: Precision, device_kind: str) -> Precision:
    """compute.executed_precision, typed as what it returns: `precision` itself or "fp32"."""
    return cast(Precision, executed_precision(precision, device_kind))


def _calibration(cluster: ClusterProfile) -> Calibration:
    """The cluster's calibration (neutral where it has none): the bounds scale as the estimate does, else a
    calibration's factors below 1 lifted bounds above their estimates (benchmarks/results/measurements.md,
    "Calibration") and pruned what the exhaustive search keeps."""
    return cluster.calibration or _NEUTRAL


_NEUTRAL = Calibration()


def _as_run(req: PlanRequest, cluster: ClusterProfile) -> PlanRequest:
    """The request in the precision its plans run in (estimate.executed: fp32 on CPU ranks), for the bounds and the
    bytes a split must fit, which the estimate counts that way; the plans keep the requested precision."""
    return replace(req, precision=_executed(req.precision, cluster.device.kind))


def search(profile: ModelProfile, cluster: ClusterProfile, request: PlanRequest, *,
           on_progress: ProgressFn | None = None) -> SearchResult:
    """Enumerate, prune and cost (module doc), at each context-parallel degree searched (planner.space.cp_degrees):
    cp > 1 searches its data view (cost.context_parallel); one branch-and-bound costs the points of every degree in
    the order of their bounds. request.prune=False costs every point P1 lets through, without P6-P8's shortcuts
    (the fidelity benchmark runs them all); request.schedules / micro_batch_sizes / max_v / tp_degrees /
    cp_degrees narrow the space."""
    req = request
    gpus = req.resolved_gpus(cluster)
    degrees = cp_degrees(profile, gpus, degrees=req.cp_degrees)
    ready = [d for d in (_prepare(profile if cp == 1 else cp_view(profile, cp), cluster, req, gpus, cp)
                         for cp in degrees) if d is not None]
    if not ready:
        raise ConfigError(f"no context-parallel degree of {', '.join(map(str, degrees))} gives a (dp, pp, tp, cp) "
                          f"split of {gpus} devices that divides the global batch {req.global_batch_size}")
    times = _branch_and_bound(ready, cluster, req, on_progress)
    found = [_result(d, times, cluster, req, gpus) for d in ready]
    feasible = sorted((c for r in found for c in r.feasible),
                      key=lambda c: (c.estimate.step_time_s, c.estimate.peak_memory_bytes))
    # full estimates (bubble and p2p apart) for what a plan shows; only the winner's lists every rank (memory and
    # action order: the plan file's prediction), the alternatives keep one memory entry per pipeline rank
    feasible[:req.top_k] = [replace(c, estimate=estimate(c.strategy, profile, cluster, per_rank=i == 0))
                            for i, c in enumerate(feasible[:req.top_k])]
    base = found[0]

    def least(field_name: str) -> dict:
        out: dict = {}
        for r in found:
            for k, v in getattr(r, field_name).items():
                out[k] = min(v, out.get(k, math.inf))
        return out
    return SearchResult(feasible=feasible, infeasible=[c for r in found for c in r.infeasible],
                        considered=sum(r.considered for r in found), pruned=sum(r.pruned for r in found),
                        costed=sum(r.costed for r in found), pruned_bounds=least("pruned_bounds"),
                        min_state=min(r.min_state for r in found), min_need=min(r.min_need for r in found),
                        unit_cost=base.unit_cost, gpus=gpus, tp=base.tp,
                        pruned_tp_bounds=least("pruned_tp_bounds"), pruned_ep_bounds=least("pruned_ep_bounds"),
                        pruned_cp_bounds={r.cp_degrees[0]: min(r.pruned_bounds.values(), default=math.inf)
                                          for r in found if r.pruned_bounds},
                        cp_degrees=tuple(r.cp_degrees[0] for r in found),
                        unit_costs={r.cp_degrees[0]: r.unit_cost for r in found})


def _prepare(profile: ModelProfile, cluster: ClusterProfile, req: PlanRequest, gpus: int, cp: int) -> _Degree | None:
    """One context-parallel degree's points, bounds and frontier (`profile`: cp_view's for cp > 1); None where it
    has no points."""
    run = _as_run(req, cluster)
    at = functools.partial(bound_unit_times, profile, cluster, req)
    parts = _Partitions(profile, at(profile.micro_batch_size), dtype_ratio=dtype_ratio(profile, run.precision),
                        at_batch=at, cp=cp)
    tp = search_tp(profile, cluster, gpus, req)
    points = _points(profile, gpus, req, parts, tp, gpu=cluster.device.kind == "gpu", cp=cp)
    if not points:
        return None
    bounds = _bounded(points, profile, cluster, parts, run)
    return _Degree(cp=cp, profile=profile, parts=parts, tp=tp, points=points, bounds=bounds,
                   frontier=_Frontier(bounds.survivors, bounds.must))


def _result(d: _Degree, times: list[float], cluster: ClusterProfile, req: PlanRequest, gpus: int) -> SearchResult:
    """One degree's SearchResult once the branch-and-bound has ended (`times`: every degree's feasible times)."""
    rest = d.frontier.rest()
    pruned, costed, infeasible = d.bounds.pruned + len(rest), d.costed, list(d.infeasible)
    fastest_unfit = _memory_limited(d.bounds, times, d.profile, cluster, d.parts, req)
    if fastest_unfit is not None:
        infeasible.append(fastest_unfit)
        costed += 1
    pruned_bounds: dict[str, float] = {}   # family -> least time bound among points never costed
    pruned_tp: dict[int, float] = {}       # the same per tp
    pruned_ep: dict[int, float] = {}       # and per ep
    for later_bound, later in rest:
        pruned_bounds.setdefault(later.family, later_bound)
        pruned_tp.setdefault(later.tp, later_bound)
        pruned_ep.setdefault(later.ep, later_bound)
    return SearchResult(feasible=d.feasible, infeasible=infeasible, considered=len(d.points), pruned=pruned,
                        costed=costed, pruned_bounds=pruned_bounds, min_state=d.bounds.min_state,
                        min_need=d.bounds.min_need,
                        unit_cost=d.parts.unit_cost, gpus=gpus, tp=d.tp, pruned_tp_bounds=pruned_tp,
                        pruned_ep_bounds=pruned_ep, cp_degrees=(d.cp,))


def _no_fit(found: SearchResult, capacity: int, no_pipelines: str | None) -> InfeasibleError:
    if found.infeasible:
        least = min(c.estimate.peak_memory_bytes for c in found.infeasible)
        need = f"the least memory any strategy needs is {fixed(least, 'GiB', 1)} per device"
    elif found.min_state > capacity:  # every point failed the model-state bound P1 before costing
        need = f"model states alone need at least {fixed(found.min_state, 'GiB', 1)} per device"
    else:  # the rest failed P8: states and the least activations any attempt keeps
        need = (f"model states and the least activations any strategy keeps need at least "
                f"{fixed(found.min_need, 'GiB', 1)} per device")
    tried = (f"ZeRO-3, full recompute and micro-batches down to 1 were tried; pipelines were not, the model cannot "
             f"be pipelined: {no_pipelines}" if no_pipelines else
             "ZeRO-3, full recompute, micro-batches down to 1 and every pipeline depth were tried")
    top_tp = max(tp for tp, _ in found.tp.pairs)
    tried += (f"; tensor parallelism up to tp={top_tp} too" if top_tp > 1 else
              f"; no tensor parallelism: {found.tp.refusal}" if found.tp.refusal else "")
    return InfeasibleError(
        f"no strategy fits: {need}, the device has {fixed(capacity, 'GiB', 1)}; use more GPUs (--gpus/--nodes) "
        f"or a device with more memory ({tried})")


@contextlib.contextmanager
def _frozen_heap():
    """Keep the objects alive before the search (the profile's thousands of records) out of the garbage
    collector's passes while it runs (gc.freeze): the search allocates enough to trigger a collection every few
    milliseconds, and each one walked the whole profile again (a quarter of llama3-70b's plan on 1,024 GPUs:
    benchmarks/results/planning_speed.json). Unfrozen after, so they are collected as usual."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def plan(profile: ModelProfile, cluster: ClusterProfile, request: PlanRequest, *, profile_path: str = "",
         command: str = "", on_progress: ProgressFn | None = None) -> Plan:
    """Search every strategy the request allows on `cluster`; return the Plan with its rationale and provenance."""
    t0 = time.perf_counter()
    with _frozen_heap():
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
    rationale = replace(rationale, lines=rationale.lines + tuple(tp_lines(
        winner.strategy, winner.estimate, feasible, cluster, found.tp, pruned_tp_bounds=found.pruned_tp_bounds,
        at_tp1=_at_tp1(winner.strategy, profile, cluster))) + tuple(ep_lines(
        winner.strategy, winner.estimate, feasible, experts=profile.experts,
        degrees=ep_degrees(profile.experts, degrees=request.ep_degrees), pruned=found.pruned_ep_bounds,
        load=imbalance_source(profile, winner.strategy.ep, peak=winner.estimate.ep_peak_load),
        at_ep1=estimate(replace(winner.strategy, ep=1), profile, cluster, compact=True)
        if winner.strategy.ep > 1 else None)) + tuple(cp_lines(
        winner.strategy, winner.estimate, feasible, seq_len=profile.seq_len, degrees=found.cp_degrees,
        pruned=found.pruned_cp_bounds, at_cp1=_at_cp1(winner.strategy, profile, cluster))))
    provenance = _provenance(found, winner, profile, cluster, request, profile_path=profile_path, command=command,
                             t0=t0)
    s = winner.strategy
    return Plan(model=model_ref(profile), cluster=cluster, gpus=found.gpus, global_batch_size=request.global_batch_size,
                strategy=s, stage_ranks=tuple(s.stage_ranks(i) for i in range(s.n_stages)), prediction=winner.estimate,
                alternatives=alternatives, candidates=_candidates(feasible + infeasible), rationale=rationale,
                provenance=provenance)


def _at_cp1(s: Strategy, profile: ModelProfile, cluster: ClusterProfile) -> Estimate | None:
    """The chosen strategy without context parallelism (whole sequences on dp x tp x pp devices; ZeRO off where
    that leaves one data-parallel rank): what CP saves in memory, for the rationale. None when cp = 1."""
    if s.cp == 1:
        return None
    whole = replace(s, cp=1, zero=s.zero if s.dp > 1 else 0,
                    distributed_optimizer=s.distributed_optimizer and s.dp > 1)
    return estimate(whole, profile, cluster, compact=True)


def _at_tp1(s: Strategy, profile: ModelProfile, cluster: ClusterProfile) -> Estimate | None:
    """The chosen strategy without tensor parallelism (same dp, pp, ZeRO, micro-batches and stages; fewer devices):
    what TP saves in memory, for the rationale. None when tp = 1."""
    if s.tp == 1:
        return None
    return estimate(s.without_tp(), profile, cluster, compact=True)


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
    cp = winner.strategy.cp   # a context-parallel winner's cut was made on its degree's view of the profile
    partitioner, milp_status, milp_b, dp_b = _partition_provenance(
        winner, cp_view(profile, cp) if cp > 1 else profile, found.unit_costs[cp],
        request.time_limit_s)
    return Provenance(
        profile_path=profile_path, profile_digest=profile_digest(profile_path) if profile_path else "",
        cluster=cluster.name, partitioner=partitioner, milp_status=milp_status, milp_bottleneck_s=milp_b,
        dp_bottleneck_s=dp_b, points_considered=found.considered, points_pruned=found.pruned,
        points_costed=found.costed, planning_time_s=time.perf_counter() - t0,
        versions=installed_versions(), command=command, created_at=now_utc(),
        profile_conditions=profile_conditions(profile))


# The MILP cross-check's default (PlanRequest.time_limit_s None): up to 1 s on cuts of up to 256 unit x stage
# binaries, none past them: CBC proves random cuts up to that size within a second and larger ones not within
# seconds (measured: benchmarks/results/measurements.md, "MILP cross-check time limit"). Past that size it cannot
# settle in seconds what the exact DP already has, and would cost more than the whole search
# (benchmarks/planning_speed.py).
MILP_AUTO = (1.0, 256)


def _partition_provenance(winner: _Costed, profile: ModelProfile, unit_cost: list[float],
                          time_limit_s: float | None) -> tuple[str, str, float | None, float | None]:
    """Solve the winner's stage cut again as a MILP and with the exact DP; record both bottlenecks and the status."""
    s = winner.strategy
    if s.n_stages == 1:
        return ("none (one stage)", "not needed", None, None)
    if not profile.is_chain:
        return ("dag-networkx", "not run (the MILP models chains)", None, None)
    scale = s.micro_batch_size / profile.micro_batch_size
    problem = PartitionProblem(costs=tuple(c * scale for c in unit_cost), n_stages=s.n_stages)
    dp_ranges = dp_partition(problem)
    if time_limit_s is None:
        time_limit_s, most = MILP_AUTO
        if len(unit_cost) * s.n_stages > most:
            return ("chain-dp", f"not run: {len(unit_cost)} units x {s.n_stages} stages is past what the MILP settles "
                                f"in {time_limit_s:g} s (--time-limit S runs it)", None, problem.bottleneck(dp_ranges))
    try:
        _, status, objective = milp_partition(problem, time_limit_s=time_limit_s)
    except InfeasibleError as exc:
        return ("chain-dp", f"failed: {exc}", None, problem.bottleneck(dp_ranges))
    return ("chain-dp", status, objective, problem.bottleneck(dp_ranges))
