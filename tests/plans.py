"""Plan files for a chosen strategy (tests that need a specific plan shape rather than the planner's pick)."""
from cost_models.records.presets import preset
from cost_models.records.strategy import Strategy
from planner.manual import manual_plan
from planner.plan import Plan

GPT_TINY_UNITS = ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head")


def plan_for(strategy: Strategy, profile, *, cluster=None) -> Plan:
    return manual_plan(strategy, profile, cluster or preset("dgx-a100"), command="test")


def plan_file(tmp_path, strategy: Strategy, profile, name: str = "plan.json"):
    return plan_for(strategy, profile).save(tmp_path / name)
