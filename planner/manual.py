"""Build one Strategy from flags (what `planner estimate` evaluates): stages balanced by the exact chain DP."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from cost_models.cost.compute import unit_times
from cost_models.cost.context_parallel import cp_refusal
from cost_models.cost.estimate import estimate
from cost_models.cost.lengths import at_seq_len
from cost_models.cost.moe import check_ep
from cost_models.records.base import Record, record
from cost_models.records.cluster import ClusterProfile
from cost_models.records.errors import ConfigError, InfeasibleError, ModelSourceError
from cost_models.records.files import ProfileFile
from cost_models.records.formatting import fixed, now_utc
from cost_models.records.limits import check_global_batch, check_gpus, check_microbatches
from cost_models.records.precision import Optimizer, Precision
from cost_models.records.profile import ModelProfile
from cost_models.records.schedule import DEFAULT_SCHEDULE
from cost_models.records.strategy import Strategy, check_cp_degree, check_tp_degree, tp_node_refusal
from cost_models.records.validate import validate_cluster
from planner.partition import balanced_partition, stages_from_ranges
from planner.plan import Plan, Provenance, installed_versions, model_ref, profile_digest
from planner.rationale import by_hand
from planner.summaries import profile_conditions


def load_profile_for(path: str | Path, *, cluster: str | None = None, nodes: int | None = None,
                     seq_len: int | None = None) -> tuple[ProfileFile, ClusterProfile]:
    """The profile and the cluster to plan for: --cluster (a preset or file) if given, else the profile's own,
    scaled to --nodes; the profile seen at --seq-len where given (at_length)."""
    from cost_models.profiling.cluster_source import check_cluster_args, resolve_cluster
    check_cluster_args(cluster or "the profile's", nodes=nodes, ranks=None)   # --nodes 0 is an error, not "default"
    pf = ProfileFile.load(path)
    target = resolve_cluster(cluster, nodes=nodes) if cluster else pf.cluster
    if target is None:
        raise ConfigError(f"{path} has no cluster; pass --cluster PRESET|FILE")
    if nodes is not None and not cluster:
        target = target.with_nodes(nodes)
        validate_cluster(target, str(path), fix="plan for a preset or cluster file that has an inter-node link")
    return (at_length(pf, seq_len) if seq_len is not None else pf), target


def at_length(pf: ProfileFile, seq_len: int) -> ProfileFile:
    """`pf` with its model seen at `seq_len` tokens per sequence (cost.lengths.at_seq_len), after checking that
    the model takes that many (its positions table, Llama 3's context): the run would refuse it, not the plan."""
    m = pf.model
    if seq_len == m.seq_len:
        return pf
    _check_model_length(m.source, seq_len)
    return dataclasses.replace(pf, model=at_seq_len(m, seq_len))


def _check_model_length(source: str, seq_len: int) -> None:
    """ModelSource.check_seq_len for a zoo or transformers model; a module:factory model is not imported to plan
    it, and a config this machine cannot read is not checked here (the run checks its input)."""
    from cost_models.models.source import resolve
    from cost_models.models.zoo import ZOO
    if source not in ZOO and not source.startswith("hf:"):
        return
    try:
        ref = resolve(source)
    except ModelSourceError:
        return
    ref.check_seq_len(seq_len)


def parse_recompute(text: str, n_stages: int) -> tuple[tuple[bool, ...], bool]:
    """(per-stage full recompute, selective) from --recompute: 'none' | 'selective' (the attention core of every
    stage, Korthikanti et al. 2022) | 'full' or 'all' | comma-separated stage indices, e.g. '0,1' (full recompute
    there)."""
    if text == "none":
        return (), False
    if text == "selective":
        return (), True
    if text in ("all", "full"):
        return (True,) * n_stages, False
    try:
        chosen = {int(t) for t in text.split(",") if t.strip()}
    except ValueError:
        raise ConfigError(f"--recompute takes none, selective, full, or stage indices like 0,1 (got '{text}')") from None
    if any(i < 0 or i >= n_stages for i in chosen):
        raise ConfigError(f"--recompute stage indices must be in 0..{n_stages - 1}")
    return tuple(i in chosen for i in range(n_stages)), False


@record
class StrategyRequest(Record):
    """A strategy as `planner estimate` is given it (its flags): degrees, schedule and micro-batching; the stages
    are cut by build_strategy."""

    dp: int = 1
    pp: int = 1
    zero: int = 0
    schedule: str = DEFAULT_SCHEDULE
    microbatches: int = 1
    micro_batch_size: int | None = None   # None: the profile's; an explicit 0 is an error, not "default"
    v: int = 1
    tp: int = 1                           # tensor-parallel degree (inside a node: mesh (pp, dp, tp))
    sp: bool = False                      # sequence parallelism over the tp group
    recompute: str = "none"               # none | selective | full (or all) | stage indices, e.g. "0,1"
    precision: Precision = "bf16-mixed"
    optimizer: Optimizer = "adamw"
    distributed_optimizer: bool = False   # ZeRO-1 as Megatron-LM's (Strategy.zero_label)
    async_tp: bool = False                # SP's collectives behind their matmuls (Strategy.tp_label)
    sp_save_shard: bool = False           # SP's gathered inputs saved as their shard (Strategy.tp_label)
    ep: int = 1                           # expert-parallel degree (Strategy.ep)
    cp: int = 1                           # context-parallel degree (Strategy.cp)


def check_tp(profile: ModelProfile, cluster: ClusterProfile, *, tp: int, sp: bool, pp: int = 1) -> None:
    """ConfigError (one line, what to change) unless this model can be split tp ways (with SP) inside a node."""
    check_tp_degree(tp, sp)
    if tp == 1:
        return
    node = tp_node_refusal(tp, cluster.devices_per_node)
    if node:
        raise ConfigError(f"{node}; use a --tp that divides it")
    shape = profile.tensor_parallel
    why = ("the profile predates tensor-parallel plans; re-run planner profile" if shape is None
           else shape.tp_refusal(tp, sp=sp, seq_len=profile.seq_len, pp=pp))
    if why:
        raise ConfigError(f"--tp {tp}{' --sp' if sp else ''}: {profile.name}: {why}; use --tp 1"
                          + (" or drop --sp" if sp and shape is not None and not shape.tp_refusal(tp) else ""))


def build_strategy(profile: ModelProfile, cluster: ClusterProfile, request: StrategyRequest) -> Strategy:
    """The requested strategy, its pp*v stages cut where they balance the predicted per-unit time."""
    r = request
    dp, pp, tp, v, microbatches, precision = r.dp, r.pp, r.tp, r.v, r.microbatches, r.precision
    mbs = profile.micro_batch_size if r.micro_batch_size is None else r.micro_batch_size
    cp = r.cp
    if dp < 1 or pp < 1 or tp < 1 or cp < 1 or v < 1 or microbatches < 1 or mbs < 1:
        raise ConfigError("--dp, --pp, --tp, --cp, --v, --microbatches and --micro-batch-size must be >= 1")
    check_cp_degree(cp)
    # the caps of cost_models/records/limits.py, checked on the flags before any work sized by them
    check_gpus(dp, "--dp")
    check_gpus(dp * cp * pp * tp, "--dp x --cp x --tp x --pp =")
    check_microbatches(microbatches)
    check_global_batch(dp * microbatches * mbs, "--dp x --microbatches x --micro-batch-size =")
    if dp * cp * pp * tp > cluster.world_size:
        raise ConfigError(f"dp x cp x tp x pp = {dp * cp * pp * tp} ranks, but the cluster has "
                          f"{cluster.world_size}; lower --dp/--cp/--tp/--pp or add --nodes")
    refusal = profile.pipeline_refusal
    if pp > 1 and refusal:
        raise ConfigError(f"--pp {pp}: {profile.name} cannot be pipelined: {refusal}; use --pp 1")
    # under CP a rank's sequence is seq_len / cp tokens, which sequence parallelism splits tp ways
    check_tp(dataclasses.replace(profile, seq_len=profile.seq_len // cp) if cp > 1 else profile, cluster, tp=tp,
             sp=r.sp, pp=pp)
    why = check_ep(profile, r.ep) or cp_refusal(profile, cp)
    if why:
        raise ConfigError(why)
    n_stages = pp * v
    if n_stages > len(profile.units):
        raise ConfigError(f"pp x v = {n_stages} stages, but the model has only {len(profile.units)} units")
    costs = [sum(unit_times(u, profile, cluster, micro_batch_size=mbs, precision=precision,
                            ranks_running=dp * cp * pp * tp)) for u in profile.units]
    ranges = balanced_partition(costs, n_stages)
    recompute, selective = parse_recompute(r.recompute, n_stages)
    return Strategy(dp=dp, pp=pp, zero=r.zero, schedule=r.schedule, microbatches=microbatches, micro_batch_size=mbs,
                    v=v, stages=stages_from_ranges([u.name for u in profile.units], ranges), recompute=recompute,
                    tp=tp, sp=r.sp, selective=selective, precision=precision, optimizer=r.optimizer,
                    distributed_optimizer=r.distributed_optimizer, async_tp=r.async_tp,
                    sp_save_shard=r.sp_save_shard, ep=r.ep, cp=cp)


def executor_refuses(strategy: Strategy, profile: ModelProfile) -> str | None:
    """Why `planner run` would refuse the strategy on this model (a model it cannot cut into stages, the schedule
    registry's guards), or None."""
    if strategy.pp > 1 and profile.pipeline_refusal:
        return f"{profile.name} cannot be pipelined: {profile.pipeline_refusal}"
    if strategy.tp > 1:
        shape = profile.tensor_parallel
        why = ("the profile predates tensor-parallel plans" if shape is None
               else shape.tp_refusal(strategy.tp, sp=strategy.sp, seq_len=profile.seq_len, pp=strategy.pp))
        if why:
            return f"{profile.name} cannot be split {strategy.tp} ways: {why}"
    return strategy.unsafe_reason() or strategy.split_tie(sp.units for sp in profile.shared)


def check_fits(est) -> None:
    """InfeasibleError (exit 3) naming the fullest rank, unless the estimate fits."""
    if not est.fits:
        worst = max(est.memory_per_rank, key=lambda m: m.total_bytes)
        raise InfeasibleError(f"does not fit: rank {worst.rank} needs {fixed(worst.total_bytes, 'GiB')}, the device "
                              f"has {fixed(est.capacity_bytes, 'GiB')}; try more --zero, --recompute selective or full, a "
                              f"smaller --micro-batch-size, or more --pp or --tp")


def manual_plan(strategy: Strategy, profile: ModelProfile, cluster: ClusterProfile, *, profile_path: str = "",
                command: str = "") -> Plan:
    """A plan of exactly `strategy` (`planner estimate -o`; tests that need a given shape): the same format as
    `planner plan`'s, its rationale and provenance saying it was chosen by hand. Refuses (InfeasibleError) a
    strategy that does not fit."""
    t0 = time.perf_counter()
    s = strategy
    refused = executor_refuses(s, profile)
    if refused:
        raise ConfigError(f"planner run would refuse this strategy: {refused}")
    est = estimate(s, profile, cluster)
    check_fits(est)
    provenance = Provenance(
        profile_path=profile_path, profile_digest=profile_digest(profile_path) if profile_path else "",
        cluster=cluster.name, partitioner="chain-dp (balanced, chosen by hand)" if s.n_stages > 1 else "none (one stage)",
        milp_status="not run (chosen by hand)", milp_bottleneck_s=None, dp_bottleneck_s=None, points_considered=1,
        points_pruned=0, points_costed=1, planning_time_s=time.perf_counter() - t0, versions=installed_versions(),
        command=command, created_at=now_utc(), profile_conditions=profile_conditions(profile))
    return Plan(model=model_ref(profile), cluster=cluster, gpus=s.world_size, global_batch_size=s.global_batch_size,
                strategy=s, stage_ranks=tuple(s.stage_ranks(i) for i in range(s.n_stages)), prediction=est, alternatives=(),
                rationale=by_hand(s, est, cluster, at_tp1=estimate(s.without_tp(), profile, cluster,
                                                                   compact=True) if s.tp > 1 else None),
                provenance=provenance)
