"""The executor for real: multi-process gloo ranks, every plan shape the planner emits, against one process."""
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cost_models.cost.estimate import estimate
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.presets import preset
from cost_models.records.strategy import Strategy
from executor.launch import WARMUP_STEPS, run_many
from executor.train import TrainConfig, single_process_losses
from tests.plans import plan_file

ROOT = Path(__file__).resolve().parents[1]
UNITS = ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head")   # gpt-tiny: tied embedding and head
CFG = TrainConfig(model_source="gpt-tiny", seq_len=16, input_kind="tokens", steps=5, warmup=1, seed=3, lr=1e-2)
GLOBAL = 8


def S(dp, pp, zero=0, schedule="1f1b", v=1, m=None, stages=None):
    m = m or GLOBAL // dp
    if stages is None:
        k = pp * v
        cuts = {1: [6], 2: [3, 6], 4: [2, 3, 4, 6]}[k]
        stages, a = [], 0
        for b in cuts:
            stages.append(UNITS[a:b])
            a = b
    return Strategy(dp=dp, pp=pp, zero=zero, schedule=schedule, microbatches=m, micro_batch_size=GLOBAL // (dp * m),
                    v=v, stages=tuple(stages), precision="fp32", optimizer="adamw")


@pytest.fixture(scope="module")
def reference():
    return single_process_losses(S(1, 1), CFG)


@pytest.fixture(scope="module")
def profile():
    # at micro-batch 2, so that runs at 1 and 4 check the scaling of activations too (memory.saved_at)
    return profile_model(resolve("gpt-tiny"), micro_batch_size=2, seq_len=16, meta=True, dtype="fp32")


def check(strategies, results, reference, profile):
    for s, ranks in zip(strategies, results):
        for r in ranks:
            assert r["losses"] == pytest.approx(reference, rel=1e-4), (s.dp, s.pp, s.zero, s.schedule, r["rank"])
        predicted = estimate(s, profile, preset("dgx-a100")).memory_per_rank
        for r in ranks:
            m = predicted[r["rank"]]
            for measured, expected in ((r["parameter_bytes"], m.parameters), (r["gradient_bytes"], m.gradients),
                                       (r["optimizer_state_bytes"], m.optimizer_states)):
                assert measured == pytest.approx(expected, rel=0.05), (s.dp, s.pp, s.zero, r["rank"])
            check_activations(s, r["activation_bytes"], m.activations, r["rank"])


def check_activations(s: Strategy, measured: int, predicted: int, rank: int) -> None:
    """Activations held for backward (executor.activations), measured in the counted step, within 10% of the
    estimate on every rank, split-backward schedules included (what they keep to the end of the step)."""
    assert measured > 0, (s.name, rank)
    assert measured == pytest.approx(predicted, rel=0.10), (s.name, rank, measured, predicted)


@pytest.mark.slow
def test_two_ranks_every_zero_stage_and_pipeline_schedule(reference, profile):
    strategies = [S(2, 1, z) for z in range(4)] + [S(1, 2, schedule="gpipe", m=4), S(1, 2, m=4),
                                                   S(1, 2, schedule="interleaved-1f1b", v=2, m=4),
                                                   S(1, 2, schedule="zb-interleaved", m=4),
                                                   dataclasses.replace(S(1, 2, m=4), recompute=(True, False)),
                                                   dataclasses.replace(S(2, 1, 1), recompute=(True,)),
                                                   dataclasses.replace(S(2, 1, 1), distributed_optimizer=True)]
    results = [[r.to_dict() for r in ranks] for ranks in run_many(2, strategies, CFG)]
    check(strategies, results, reference, profile)
    # the distributed optimizer gathers and reduce-scatters each unit once per step, ZeRO-2 once per micro-batch
    # (4 here), each as the estimate counts them
    for i in (2, len(strategies) - 1):
        predicted = estimate(strategies[i], profile, preset("dgx-a100")).comm.dp_collectives
        assert results[i][0]["comm_bytes"] == predicted, strategies[i].name
    assert results[2][0]["comm_bytes"]["all_gather"] == 4 * results[-1][0]["comm_bytes"]["all_gather"]
    # the reference really trains: every step sees another batch and updated weights, so no two losses repeat
    assert len(set(round(x, 6) for x in reference)) == 5


@pytest.mark.slow
def test_four_ranks_zero_pipeline_and_hybrids(reference, profile):
    strategies = [S(4, 1, z) for z in range(4)] + [S(1, 4, m=4), S(2, 2, 1, m=2), S(2, 2, 2, m=2),
                                                   S(2, 2, 3, m=2), S(2, 2, 2, schedule="zb-interleaved", m=2),
                                                   # one sample per micro-batch, a stage of the embedding alone,
                                                   # and what a split backward keeps under TP (estimate._kept)
                                                   S(1, 4, m=8, stages=(UNITS[:1], UNITS[1:3], UNITS[3:5], UNITS[5:])),
                                                   dataclasses.replace(S(1, 2, schedule="zb-interleaved", m=8), tp=2),
                                                   dataclasses.replace(S(1, 2, schedule="zb-interleaved", v=2, m=8),
                                                                       tp=2, sp=True)]
    results = [[r.to_dict() for r in ranks] for ranks in run_many(4, strategies, CFG)]
    check(strategies, results, reference, profile)
    # sharding is real: ZeRO-3 ranks hold a quarter of ZeRO-0's parameters
    z0, z3 = results[0][0], results[3][0]
    assert z3["parameter_bytes"] * 4 == pytest.approx(z0["parameter_bytes"], rel=0.01)
    comm = results[5][0]["comm_bytes"]   # PP2 x DP2 ZeRO-1: gradient all-reduce, parameter broadcasts, p2p
    assert comm.get("all_reduce", 0) > 0 and comm.get("broadcast", 0) > 0 and comm.get("p2p_send", 0) > 0
    # PP2 x DP2 ZeRO-1/2/3: rank 0's counted gathers (ZeRO-3: m + 1 per step), reduce-scatters and all-reduces (of
    # gradients over dp, and of the tied embedding's gradient, a ZeRO-2/3 shard, with the head's rank) are the
    # estimate's bytes
    for i in (5, 6, 7):
        est = estimate(strategies[i], profile, preset("dgx-a100")).comm
        counted = results[i][0]["comm_bytes"]
        expected = dict(est.dp_collectives, all_reduce=est.dp_collectives.get("all_reduce", 0) + est.tied_bytes_per_rank)
        for op in ("all_gather", "reduce_scatter", "all_reduce"):
            assert counted.get(op, 0) == pytest.approx(expected.get(op, 0)), (strategies[i].name, op)


def _plan_file(tmp_path, profile, strategy):
    return plan_file(tmp_path, strategy, profile)


@pytest.mark.slow
def test_planner_run_writes_run_json(tmp_path, profile, reference):
    import json
    path = _plan_file(tmp_path, profile, S(1, 2, m=4))
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, "-m", "cli", "run", str(path), "--steps", "5", "--seed", "3", "--lr", "0.01",
                           "-o", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "predicted vs measured" in proc.stdout and "step time" in proc.stdout
    run = json.loads(out.read_text())
    assert run["kind"] == "zeropipe.run" and run["world_size"] == 2 and len(run["ranks"]) == 2
    assert run["losses"] == pytest.approx(reference, rel=1e-4)
    # 5 steps, the default warm-up left out of the timing
    assert run["step_time_s"]["steps"] == 5 - WARMUP_STEPS and run["warmup"] == WARMUP_STEPS
    assert run["step_time_s"]["median_s"] > 0
    quantities = {(c["quantity"], c["unit"]) for c in run["measures"]}
    assert ("step time", "s") in quantities and ("rank 1 parameters", "B") in quantities
    # how loaded the machine was, beside the measurements
    assert len(run["load_1min"]) == 2 and all(x >= 0 for x in run["load_1min"]) and run["cpus"] == os.cpu_count()
    assert f"on {os.cpu_count()} CPUs with 2 ranks" in proc.stdout


@pytest.mark.slow
def test_a_rank_that_raises_ends_the_job_and_is_named(tmp_path, profile):
    path = _plan_file(tmp_path, profile, S(2, 1, 0))
    env = {**os.environ, "ZEROPIPE_INJECT_FAILURE": "1:2"}
    t0 = time.time()
    # the peers must not wait out the 300 s collective timeout: a wide gap from a correct end (10-40 s here)
    proc = subprocess.run([sys.executable, "-m", "cli", "run", str(path), "--steps", "5", "-o", "-", "--timeout", "300"],
                          capture_output=True, text=True, env=env, timeout=280)
    assert time.time() - t0 < 150
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: rank 1 failed: RuntimeError: injected failure at step 2"), proc.stderr[-1500:]


@pytest.mark.slow
def test_torchrun_example_runs():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "examples/train_with_plan.py"), "--steps", "3"], capture_output=True, text=True,
                          timeout=240)
    # a rank's own error comes before torchrun's summary, which alone fills the last 2,000 characters
    errors = [line for line in proc.stderr.splitlines() if "rror" in line or "what()" in line or "terminate" in line]
    assert proc.returncode == 0, "\n".join(errors[:20]) + proc.stderr[-1500:]
    losses = [line for line in proc.stdout.splitlines() if "loss" in line]
    assert len(losses) >= 3 and all(5.0 < float(line.split("loss ")[1].split()[0]) < 8.0 for line in losses)


def test_run_refuses_a_plan_this_machine_cannot_host(tmp_path):
    from typer.testing import CliRunner

    from cli import app
    from planner.request import PlanRequest
    from planner.search import plan as make_plan
    prof = profile_model(resolve("llama2-7b"), micro_batch_size=1, seq_len=64, meta=True, dtype="bf16")
    ranks = 64   # more than executor.launch.check_fits_here lets one machine's cores host: max(8, 4 x cores)
    while ranks <= max(8, 4 * (os.cpu_count() or 1)):   # (on a 16-core machine 64 ranks pass, and memory refuses)
        ranks *= 2
    big = make_plan(prof, preset("dgx-h100", nodes=ranks // 8), PlanRequest(gpus=ranks, global_batch_size=ranks))
    path = tmp_path / "plan.json"
    from cost_models.records.fileio import dumps, write_atomic
    write_atomic(path, dumps(big.to_dict()))
    res = CliRunner().invoke(app, ["run", str(path), "-o", "-"])
    assert res.exit_code == 2
    assert res.stderr.strip().startswith(f"error: the plan puts {ranks} ranks on this node")
    small = make_plan(prof, preset("dgx-h100"), PlanRequest(gpus=2, global_batch_size=8))
    write_atomic(path, dumps(small.to_dict()), overwrite=True)
    res = CliRunner().invoke(app, ["run", str(path), "-o", "-"])
    assert res.exit_code == 2 and "GiB, this machine has" in res.stderr   # 7B of model states on CPU ranks
