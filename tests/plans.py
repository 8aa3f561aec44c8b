"""Plan files for a chosen strategy (tests that need a specific plan shape rather than the planner's pick)."""
from cost_models.estimate import estimate
from cost_models.fileio import dumps, write_atomic
from cost_models.presets import preset
from cost_models.strategy import Strategy
from planner.plan import ModelRef, Plan, Provenance, Rationale

GPT_TINY_UNITS = ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head")


def plan_for(strategy: Strategy, profile, *, cluster=None) -> Plan:
    cluster = cluster or preset("dgx-a100")
    est = estimate(strategy, profile, cluster)
    return Plan(model=ModelRef(name=profile.name, source=profile.source, seq_len=profile.seq_len,
                               input_kind=profile.input.kind, units=tuple(u.name for u in profile.units)),
                cluster=cluster, gpus=strategy.world_size, global_batch_size=strategy.global_batch_size,
                strategy=strategy, stage_ranks=tuple(strategy.stage_ranks(i) for i in range(strategy.n_stages)),
                prediction=est, alternatives=(),
                rationale=Rationale(binding="compute", winner_family="pipeline" if strategy.pp > 1 else "zero",
                                    summary="fixed by the test", lines=("chosen: fixed by the test", "why: the test"),
                                    best_by_family={}),
                provenance=Provenance(profile_path="", profile_digest="", cluster=cluster.name, partitioner="chain-dp",
                                      milp_status="not run", milp_bottleneck_s=None, dp_bottleneck_s=None,
                                      points_considered=1, points_pruned=0, points_costed=1, planning_time_s=0.0,
                                      versions={}, command="test", created_at=""))


def plan_file(tmp_path, strategy: Strategy, profile, name: str = "plan.json"):
    return write_atomic(tmp_path / name, dumps(plan_for(strategy, profile).to_dict()))
