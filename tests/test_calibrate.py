"""Calibration from runs (planner/calibrate.py, `planner calibrate`): the fit recovers known factors from synthetic
runs built from real estimates, the estimate applies a calibration exactly, cluster files keep it, bad inputs are
one-line typed errors. No ranks are spawned."""
import dataclasses

import pytest
from typer.testing import CliRunner

from cli import app
from cost_models.cost.estimate import estimate
from cost_models.records.cluster import Calibration, ComputeProbe
from cost_models.records.errors import ConfigError, FileFormatError
from cost_models.records.files import ClusterFile
from cost_models.records.presets import preset
from planner.calibrate import MeasuredParts, calibrate, fit, measured_parts, predict_after, predicted_parts
from planner.run_record import RankResult
from tests.plans import plan_file, plan_for

PROBED_ACTION_S = 1e-4


@pytest.fixture(scope="module")
def setup():
    """gpt-tiny (meta) on a DGX-A100 preset that carries a probed per-action cost, and a spread of strategies:
    with and without a pipeline, data parallelism and ZeRO stages."""
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model
    from planner.request import PlanRequest
    from planner.search import search
    prof = profile_model(resolve("gpt-tiny"), micro_batch_size=2, seq_len=16, dtype="fp32", meta=True)
    probe = ComputeProbe(dtype="fp32", matmul_n=512, ranks=8, threads_per_rank=1, flops_per_rank=1e12,
                         flops_alone=1e12, pipeline_action_s=PROBED_ACTION_S)
    # CPU ranks, as calibration meets them: no collective hides behind compute, so the factors act independently
    base = preset("dgx-a100")
    cluster = dataclasses.replace(base, compute=probe, device=dataclasses.replace(base.device, kind="cpu"))
    request = PlanRequest(gpus=8, global_batch_size=32, precision="fp32", prune=False, tp_degrees=(1,))
    found = search(prof, cluster, request)
    strategies = [c.strategy for c in found.feasible][::7][:12]
    assert len({s.pp for s in strategies}) > 1 and len({s.zero for s in strategies}) > 1
    return prof, cluster, strategies


def _synthetic(parts, *, compute=1.7, optimizer=0.9, dp=1.0, action=None):
    """What a run would measure if the true factors were these (the estimate's own structure, module doc)."""
    action = parts.action_s if action is None else action
    step = predict_after(parts, compute_scale=compute, optimizer_scale=optimizer, dp_comm_scale=dp,
                         pipeline_action_s=action)
    inside = compute * parts.unit_compute_s + action * parts.actions + parts.tp_comm_s + dp * parts.dp_comm_s
    return MeasuredParts(step_s=step, compute_s=inside * 0.8, sync_s=inside * 0.2,
                         optimizer_s=optimizer * parts.optimizer_s)


def _pairs(setup, **truth):
    prof, cluster, strategies = setup
    out = []
    for s in strategies:
        p = predicted_parts(estimate(s, prof, cluster), s, cluster)
        out.append((p, _synthetic(p, **truth)))
    return out


def test_fit_recovers_compute_and_optimizer_scales(setup):
    f = fit(_pairs(setup, compute=1.7, optimizer=0.9))
    assert f.compute_scale == pytest.approx(1.7, rel=0.01) and f.optimizer_scale == pytest.approx(0.9, rel=0.01)
    assert f.mape_after < 1e-6 < f.mape_before


def test_fit_recovers_per_action_and_data_parallel_terms(setup):
    f = fit(_pairs(setup, compute=1.3, optimizer=2.0, dp=1.5, action=3 * PROBED_ACTION_S))
    assert {"pipeline_action_s", "dp_comm_scale"} <= set(f.fitted)
    assert f.pipeline_action_s == pytest.approx(3 * PROBED_ACTION_S, rel=0.01)
    assert f.dp_comm_scale == pytest.approx(1.5, rel=0.01) and f.compute_scale == pytest.approx(1.3, rel=0.01)


def test_one_run_fits_one_compute_factor(setup):
    f = fit(_pairs(setup)[:1])
    assert set(f.fitted) <= {"compute_scale", "optimizer_scale"} and f.pipeline_action_s is None
    assert f.after_s[0] == pytest.approx(f.measured_s[0])


def test_a_calibrated_cluster_scales_the_estimate_exactly(setup):
    prof, cluster, strategies = setup
    s = next(s for s in strategies if s.pp == 1)
    cal = Calibration(compute_scale=1.7, optimizer_scale=0.9, dp_comm_scale=1.25, fitted=("compute_scale",))
    before, after = (estimate(s, prof, c) for c in (cluster, dataclasses.replace(cluster, calibration=cal)))
    assert after.breakdown.compute_s == pytest.approx(1.7 * before.breakdown.compute_s, rel=1e-12)
    assert after.breakdown.optimizer_s == pytest.approx(0.9 * before.breakdown.optimizer_s, rel=1e-12)
    assert after.breakdown.dp_comm_s == pytest.approx(1.25 * before.breakdown.dp_comm_s, rel=1e-12)
    parts = predicted_parts(before, s, cluster)
    assert after.step_time_s == pytest.approx(predict_after(parts, compute_scale=1.7, optimizer_scale=0.9,
                                                            dp_comm_scale=1.25), rel=1e-12)
    assert after.calibrated_by == "calibrated by hand (no runs recorded)" and before.calibrated_by == ""


def test_the_per_action_cost_replaces_the_probed_one(setup):
    prof, cluster, strategies = setup
    s = next(s for s in strategies if s.pp > 1)
    cal = Calibration(pipeline_action_s=5 * PROBED_ACTION_S)
    before, after = (estimate(s, prof, c) for c in (cluster, dataclasses.replace(cluster, calibration=cal)))
    actions = predicted_parts(before, s, cluster).actions
    assert actions > 0
    assert after.breakdown.compute_s - before.breakdown.compute_s == pytest.approx(4 * PROBED_ACTION_S * actions)


def test_each_kind_of_schedule_pays_its_own_probed_per_action_cost(setup):
    """torch's multi-stage runtime (interleaved 1F1B; zero-bubble with its split backward) costs more per action
    than its single-stage classes (overhead_probe): each kind is charged its own probe, and a calibrated value
    replaces all three."""
    from planner.request import PlanRequest
    from planner.search import search
    prof, cluster, _ = setup
    found = search(prof, cluster, PlanRequest(gpus=8, global_batch_size=32, precision="fp32", prune=False,
                                              tp_degrees=(1,), max_v=2))
    pick = {name: next(c.strategy for c in found.feasible if c.strategy.schedule == name and c.strategy.pp > 1)
            for name in ("1f1b", "interleaved-1f1b", "zb-interleaved")}
    runtime, split = 7 * PROBED_ACTION_S, 3 * PROBED_ACTION_S
    probed = dataclasses.replace(cluster, compute=dataclasses.replace(
        cluster.compute, pipeline_runtime_action_s=runtime, pipeline_split_action_s=split))
    for name, per_action in (("1f1b", PROBED_ACTION_S), ("interleaved-1f1b", runtime), ("zb-interleaved", split)):
        s = pick[name]
        parts = predicted_parts(estimate(s, prof, probed), s, probed)
        assert parts.action_s == per_action
        base = estimate(s, prof, cluster)   # runtime and split not probed: every kind pays the single-stage cost
        assert (estimate(s, prof, probed).breakdown.compute_s - base.breakdown.compute_s ==
                pytest.approx((per_action - PROBED_ACTION_S) * parts.actions))
        cal = dataclasses.replace(probed, calibration=Calibration(pipeline_action_s=5 * PROBED_ACTION_S))
        assert (estimate(s, prof, cal).breakdown.compute_s - base.breakdown.compute_s ==
                pytest.approx(4 * PROBED_ACTION_S * parts.actions))


def test_cluster_file_round_trip_keeps_the_calibration(tmp_path, setup):
    _, cluster, _ = setup
    cal = Calibration(compute_scale=1.5, pipeline_action_s=2e-4, fitted=("compute_scale", "pipeline_action_s"))
    path = ClusterFile(cluster=dataclasses.replace(cluster, calibration=cal)).save(tmp_path / "c.json")
    assert ClusterFile.load(path).cluster.calibration == cal
    assert ClusterFile.load(ClusterFile(cluster=cluster).save(tmp_path / "plain.json")).cluster.calibration is None
    bad = path.read_text().replace('"compute_scale": 1.5', '"compute_scale": 0.0')
    (tmp_path / "bad.json").write_text(bad)
    with pytest.raises(FileFormatError, match=r"calibration.compute_scale is 0.0; need > 0"):
        ClusterFile.load(tmp_path / "bad.json")


# --- runs on disk ---------------------------------------------------------------------------------------------------

def _run(plan, *, compute=1.5, optimizer=2.0, compute_s=None):
    """run.json of `plan` whose ranks measured the prediction's compute (incl. data-parallel time) x `compute`."""
    from executor.launch import summarize
    b = plan.prediction.breakdown
    c = (b.compute_s + b.dp_comm_s) * compute
    o = b.optimizer_s * optimizer
    ranks = [RankResult(rank=r, pp_rank=0, dp_rank=r, stages=(0,), step_times_s=(c + o,) * 3, losses=(6.0,) * 3,
                        parameter_bytes=m.parameters, gradient_bytes=m.gradients,
                        optimizer_state_bytes=m.optimizer_states, peak_memory_bytes=m.total_bytes,
                        peak_memory_source="test", comm_bytes={}, comm_calls={},
                        compute_s=(c,) * 3 if compute_s is None else compute_s, sync_s=(0.0,) * 3, optimizer_s=(o,) * 3)
             for r, m in enumerate(plan.prediction.memory_per_rank)]
    return summarize(plan, ranks, steps=3, warmup=1, backend="gloo")


def _dp_plan(setup, tmp_path, name="plan.json", cluster=None):
    prof, base, strategies = setup
    s = next(s for s in strategies if s.pp == 1)
    plan = plan_for(s, prof, cluster=cluster or base)
    return plan, plan.save(tmp_path / name)


def test_cli_calibrate_moves_the_prediction_to_the_measurement(tmp_path, setup):
    plan, _ = _dp_plan(setup, tmp_path)
    run = _run(plan)
    run.save(tmp_path / "run.json")
    res = CliRunner().invoke(app, ["calibrate", str(tmp_path), "-o", str(tmp_path / "cal.json")])
    assert res.exit_code == 0, res.output
    assert "calibrated by 1 run(s)" in res.output and "MAPE" in res.output
    cluster = ClusterFile.load(tmp_path / "cal.json").cluster
    cal = cluster.calibration
    assert cal.runs[0].path == str((tmp_path / "run.json").resolve()) and cal.mape_after < 1e-6 < cal.mape_before
    prof = setup[0]
    again = estimate(plan.strategy, prof, cluster).step_time_s
    assert again == pytest.approx(run.step_time_s["median_s"], rel=1e-9)


def test_cli_pairs_runs_with_plans_given_elsewhere(tmp_path, setup):
    plan, plan_path = _dp_plan(setup, tmp_path, name="mine.json")
    (tmp_path / "runs").mkdir()
    _run(plan).save(tmp_path / "runs" / "r.json")
    args = ["calibrate", str(tmp_path / "runs" / "r.json"), "-o", "-"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "no plan given matches it; pass the plan.json it ran with --plan" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    res = CliRunner().invoke(app, args + ["--plan", str(plan_path)])
    assert res.exit_code == 0, res.output


def test_bad_inputs_are_one_line_errors(tmp_path, setup):
    with pytest.raises(ConfigError, match="no runs to calibrate from"):
        fit([])
    with pytest.raises(ConfigError, match="no runs to calibrate from"):
        calibrate([])
    plan, _ = _dp_plan(setup, tmp_path)
    with pytest.raises(FileFormatError, match="no per-step compute and optimizer timings"):
        measured_parts(_run(plan, compute_s=()).ranks, 1, "r.json")
    # a run of another plan (another model's or strategy's): no plan matches
    foreign = dataclasses.replace(_run(plan), model="another-model")
    foreign.save(tmp_path / "foreign.json")
    with pytest.raises(ConfigError, match=r"foreign.json is a run of .*\(another-model, .* pass the plan.json"):
        calibrate([tmp_path / "foreign.json"])
    # runs of plans made for two clusters
    plan_b, path_b = _dp_plan(setup, tmp_path, name="b.json", cluster=preset("dgx-h100"))
    _run(plan).save(tmp_path / "run.json")
    _run(plan_b).save(tmp_path / "run_b.json")
    with pytest.raises(ConfigError, match="calibrate the runs of one cluster at a time"):
        calibrate([tmp_path / "run.json", tmp_path / "run_b.json"], [path_b])


def test_a_factor_beyond_ten_either_way_is_refused_unless_asked_for(tmp_path, setup):
    """A run whose step took a million times its prediction (a stalled machine) would fit compute x ~10^6 and plans
    would print 0 tokens/s: refused in one line, kept only with --any-factor."""
    plan, _ = _dp_plan(setup, tmp_path)
    _run(plan, compute=1e6).save(tmp_path / "run.json")
    with pytest.raises(ConfigError, match=r"compute scale x .* beyond x10 either way.*--any-factor"):
        calibrate([tmp_path / "run.json"])
    _, f = calibrate([tmp_path / "run.json"], any_factor=True)
    assert f.compute_scale > 1e5
    res = CliRunner().invoke(app, ["calibrate", str(tmp_path), "-o", str(tmp_path / "cal.json")])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1 and "--any-factor" in res.stderr
    assert not (tmp_path / "cal.json").exists()
    (tmp_path / "slow").mkdir()
    _run(plan).save(tmp_path / "slow" / "run.json")   # 1.5x the prediction's compute: within the bound
    assert 1 < calibrate([tmp_path / "slow" / "run.json"], [tmp_path / "plan.json"])[1].compute_scale < 10


def test_a_calibration_from_another_models_runs_is_named_where_it_is_applied(tmp_path, setup):
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model
    from cost_models.records.fileio import dumps, write_atomic
    from cost_models.records.files import ProfileFile
    from planner.summaries import calibration_mismatch
    plan, _ = _dp_plan(setup, tmp_path)
    _run(plan).save(tmp_path / "run.json")
    cluster, _ = calibrate([tmp_path / "run.json"])
    gpt = setup[0]
    llama = profile_model(resolve("llama-tiny"), micro_batch_size=2, seq_len=16, dtype="fp32", meta=True)
    assert calibration_mismatch(gpt, cluster) is None and calibration_mismatch(llama, preset("dgx-a100")) is None
    assert "fitted on runs of gpt-tiny, not llama-tiny" in calibration_mismatch(llama, cluster)
    write_atomic(tmp_path / "cal.json", dumps(ClusterFile(cluster=cluster).to_dict()))
    write_atomic(tmp_path / "llama.json", dumps(ProfileFile(model=llama, cluster=cluster).to_dict()))
    res = CliRunner().invoke(app, ["estimate", str(tmp_path / "llama.json"), "--cluster", str(tmp_path / "cal.json"),
                                   "--dp", "2", "--precision", "fp32"])
    assert res.exit_code == 0, res.output
    assert "warning: the cluster's calibration was fitted on runs of gpt-tiny, not llama-tiny" in res.stderr


def test_fidelity_cross_validation_scores_the_held_out_half(setup):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from fidelity import calibration_cv
    rows = [{"strategy": f"s{i}", "predicted_s": p.step_s, "parts": p.to_dict(), "measured_s": m.step_s,
             "measured": {"compute": m.compute_s, "optimizer": m.optimizer_s}, "measured_sync_s": m.sync_s}
            for i, (p, m) in enumerate(_pairs(setup, compute=1.4, optimizer=1.2))]
    cv = calibration_cv(rows)
    assert cv["fit_on"] + cv["scored_on"] == len(rows) and cv["scored_on"] == len(rows) // 2
    assert cv["compute_scale"] == pytest.approx(1.4, rel=0.01) and cv["mape_after"] < 1e-6 < cv["mape_before"]
    assert cv["kendall_tau_after"] == pytest.approx(1.0)
