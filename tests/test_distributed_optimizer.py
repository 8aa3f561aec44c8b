"""ZeRO-1 as Megatron-LM's distributed optimizer (Strategy.distributed_optimizer): what the estimate charges for it.
Its run against one process (losses, state bytes, collective bytes) is in tests/test_executor.py."""
from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from cli import app
from cost_models.cost.estimate import estimate
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.errors import ConfigError
from cost_models.records.fileio import dumps, write_atomic
from cost_models.records.files import ProfileFile
from cost_models.records.presets import preset
from cost_models.records.strategy import Strategy

UNITS = ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head")


def _s(m: int, **kw) -> Strategy:
    base = dict(dp=8, pp=1, zero=1, schedule="1f1b", microbatches=m, micro_batch_size=1, stages=(UNITS,),
                distributed_optimizer=True)
    return Strategy(**{**base, **kw})


@pytest.fixture(scope="module")
def prof():
    return profile_model(resolve("gpt-tiny"), micro_batch_size=1, seq_len=32, meta=True, dtype="bf16")


def test_it_is_zero_1_without_a_pipeline():
    assert _s(2).name == "ZeRO-1 dist-opt dp=8, 2x1"
    with pytest.raises(ConfigError, match="--zero 1 --pp 1"):
        _s(2, zero=2)
    with pytest.raises(ConfigError, match="--zero 1 --pp 1"):
        _s(2, pp=2, stages=(UNITS[:3], UNITS[3:]))


def test_its_collectives_run_once_per_step_and_reduce_in_fp32(prof):
    cluster = preset("dgx-h100")
    params = prof.total_params
    for m in (1, 4):
        comm = estimate(_s(m), prof, cluster).comm.dp_collectives
        assert comm == {"all_gather": pytest.approx(2 * params), "reduce_scatter": pytest.approx(4 * params)}
    zero2 = estimate(_s(4, zero=2, distributed_optimizer=False), prof, cluster).comm.dp_collectives
    assert zero2["all_gather"] == pytest.approx(4 * 2 * params)   # ZeRO-2: every micro-batch, in bf16


def test_it_holds_shards_at_rest_and_whole_parameters_and_gradients_through_the_step(prof):
    cluster = preset("dgx-h100")
    dist = estimate(_s(4), prof, cluster).memory_per_rank[0]
    zero1 = estimate(_s(4, distributed_optimizer=False), prof, cluster).memory_per_rank[0]
    params = prof.total_params
    # fp32 master, gradient and Adam shards (torch's mixed precision: 4 + 4 + 8 bytes over 8 ranks) ...
    assert (dist.parameters, dist.gradients, dist.optimizer_states) == (params * 4 // 8, params * 4 // 8,
                                                                         params * 8 // 8)
    # ... and the bf16 parameters and gradients FSDP2 keeps whole between the first forward and the last backward
    assert dist.buffers - zero1.buffers == pytest.approx(params * (2 + 2) - 2 * params, abs=1)   # no autocast copy
    assert dist.total_bytes < zero1.total_bytes


def test_planner_estimate_takes_the_switch(tmp_path, prof):
    path = write_atomic(tmp_path / "p.json", dumps(ProfileFile(model=prof, cluster=preset("dgx-h100")).to_dict()))
    args = ["estimate", str(path), "--dp", "8", "--zero", "1", "-m", "2", "--json"]
    runner = CliRunner()
    on, off = (runner.invoke(app, args + extra) for extra in (["--distributed-optimizer"], []))
    assert on.exit_code == 0 and off.exit_code == 0, on.output
    on_json, off_json = json.loads(on.stdout), json.loads(off.stdout)
    assert on_json["comm"]["dp_collectives"].keys() == {"all_gather", "reduce_scatter"}
    assert "broadcast" in off_json["comm"]["dp_collectives"]
    refused = runner.invoke(app, ["estimate", str(path), "--dp", "8", "--zero", "2", "--distributed-optimizer"])
    assert refused.exit_code == 2 and "--zero 1 --pp 1" in refused.stderr
    assert dataclasses.replace(_s(2), distributed_optimizer=False).zero_label == "ZeRO-1"


def test_the_planner_searches_it_on_gpus_only(prof):
    from planner.request import PlanRequest
    from planner.search import search
    from tests.clusters import cpu_cluster
    req = PlanRequest(gpus=8, global_batch_size=16, top_k=40, tp_degrees=(1,), prune=False)
    on_gpus = search(prof, preset("dgx-h100"), req)
    found = {c.strategy.name for c in on_gpus.feasible}
    assert any("dist-opt" in name for name in found) and any("ZeRO-1 dp=" in name for name in found)
    on_cpus = search(prof, cpu_cluster(ranks=8), dataclasses.replace(req, precision="fp32"))
    assert not any(c.strategy.distributed_optimizer for c in on_cpus.feasible + on_cpus.infeasible)
