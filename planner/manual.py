"""Build one Strategy from flags (what `planner estimate` evaluates): stages balanced by the exact chain DP."""
from __future__ import annotations

from pathlib import Path

from cost_models.cluster import ClusterProfile
from cost_models.compute import unit_times
from cost_models.errors import ConfigError
from cost_models.fileio import read_json
from cost_models.profile import PROFILE_KIND, SCHEMA_VERSION, ModelProfile, ProfileFile
from cost_models.strategy import Strategy
from planner.partition import balanced_partition, stages_from_ranges


def load_profile(path: str | Path) -> ProfileFile:
    return ProfileFile.from_dict(read_json(path, kind=PROFILE_KIND, schema_version=SCHEMA_VERSION))


def load_profile_for(path: str | Path, *, cluster: str | None = None,
                     nodes: int | None = None) -> tuple[ProfileFile, ClusterProfile]:
    """The profile and the cluster to plan for: --cluster (a preset or file) if given, else the profile's own,
    scaled to --nodes."""
    from cost_models.cluster_source import resolve_cluster
    pf = load_profile(path)
    target = resolve_cluster(cluster, nodes=nodes) if cluster else pf.cluster
    if target is None:
        raise ConfigError(f"{path} has no cluster; pass --cluster PRESET|FILE")
    if nodes and not cluster:
        target = target.with_nodes(nodes)
    return pf, target


def parse_recompute(text: str, n_stages: int) -> tuple[bool, ...]:
    """'none' | 'all' | comma-separated stage indices, e.g. '0,1'."""
    if text == "none":
        return ()
    if text == "all":
        return (True,) * n_stages
    try:
        chosen = {int(t) for t in text.split(",") if t.strip()}
    except ValueError:
        raise ConfigError(f"--recompute takes none, all, or stage indices like 0,1 (got '{text}')") from None
    if any(i < 0 or i >= n_stages for i in chosen):
        raise ConfigError(f"--recompute stage indices must be in 0..{n_stages - 1}")
    return tuple(i in chosen for i in range(n_stages))


def build_strategy(profile: ModelProfile, cluster: ClusterProfile, *, dp: int, pp: int, zero: int, schedule: str,
                   microbatches: int, micro_batch_size: int | None = None, v: int = 1, recompute: str = "none",
                   precision: str = "bf16-mixed", optimizer: str = "adamw") -> Strategy:
    """A strategy for these flags, its pp*v stages cut where they balance the predicted per-unit time."""
    mbs = micro_batch_size or profile.micro_batch_size
    if dp < 1 or pp < 1 or v < 1 or microbatches < 1 or mbs < 1:
        raise ConfigError("--dp, --pp, --v, --microbatches and --micro-batch-size must be >= 1")
    if dp * pp > cluster.world_size:
        raise ConfigError(f"dp x pp = {dp * pp} ranks, but the cluster has {cluster.world_size}; "
                          f"lower --dp/--pp or add --nodes")
    n_stages = pp * v
    if n_stages > len(profile.units):
        raise ConfigError(f"pp x v = {n_stages} stages, but the model has only {len(profile.units)} units")
    costs = [sum(unit_times(u, profile, cluster, micro_batch_size=mbs, precision=precision, ranks_running=dp * pp))
             for u in profile.units]
    ranges = balanced_partition(costs, n_stages)
    return Strategy(dp=dp, pp=pp, zero=zero, schedule=schedule, microbatches=microbatches, micro_batch_size=mbs, v=v,
                    stages=stages_from_ranges([u.name for u in profile.units], ranges),
                    recompute=parse_recompute(recompute, n_stages), precision=precision, optimizer=optimizer)
