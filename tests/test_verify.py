"""`planner plan --verify K` (executor.verify): the choice among trials as a pure function, the plan rewritten for
a measured choice, the watchdog, the loop with launch replaced; one slow test runs the CLI on 2 ranks with the
predicted best made to fail."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from cost_models.cost.estimate import estimate
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.files import ProfileFile
from cost_models.records.presets import preset
from executor import verify as V
from planner.plan import Plan, Trial
from planner.report import render_markdown, trial_rows
from planner.request import PlanRequest
from planner.search import plan as make_plan

ROOT = Path(__file__).resolve().parents[1]
REQUEST = PlanRequest(gpus=2, global_batch_size=8, precision="fp32", tp_degrees=(1,))


def T(name: str, predicted: float, measured: float | None, failure: str | None = None) -> Trial:
    return Trial(strategy=name, summary=name, predicted_s=predicted, measured_s=measured, failure=failure,
                 steps=3 if measured is not None else 0)


@pytest.fixture(scope="module")
def profile():
    return profile_model(resolve("gpt-tiny"), micro_batch_size=1, seq_len=16, meta=True, dtype="fp32")


@pytest.fixture(scope="module")
def searched(profile):
    return make_plan(profile, preset("dgx-a100"), REQUEST, command="test")


# --- the choice (pure) ---------------------------------------------------------------------------------------

def test_pick_takes_the_fastest_measured_and_skips_failures():
    trials = [T("a", 1.0, None, "rank 0 failed: OutOfMemoryError: CUDA out of memory"), T("b", 1.1, 0.030),
              T("c", 1.2, None, "not run: too big"), T("d", 1.3, 0.020), T("e", 1.4, 0.025)]
    assert V.pick(trials) == 3


def test_pick_breaks_ties_within_one_percent_by_predicted_order():
    assert V.pick([T("a", 1.0, 0.0200), T("b", 1.1, 0.0200)]) == 0            # exact tie: the predicted best
    assert V.pick([T("a", 1.0, 0.0201), T("b", 1.1, 0.0200)]) == 0            # 0.5% slower: still a tie
    assert V.pick([T("a", 1.0, 0.0210), T("b", 1.1, 0.0200)]) == 1            # 5% slower: measurement decides
    assert V.pick([T("a", 1.0, 0.0210), T("b", 1.1, 0.0200)], tie_rel=0.1) == 0


def test_when_every_trial_fails_the_error_is_one_typed_line_naming_each():
    trials = [T("a", 1.0, None, "rank 1 failed: Signal 9 (SIGKILL)"), T("b", 1.1, None, "not run: too big")]
    with pytest.raises(V.AllTrialsFailed) as info:
        V.pick(trials)
    msg = str(info.value)
    assert "\n" not in msg and info.value.exit_code == 1
    assert msg.startswith("none of the 2 candidates --verify tried produced a step time (a: rank 1 failed: Signal 9")
    assert "b: not run: too big" in msg and msg.endswith("plan without --verify, or run one with planner run to "
                                                         "see its failure")


# --- the plan after its trials ---------------------------------------------------------------------------------

def test_a_measured_choice_takes_the_candidates_own_estimate_rationale_and_alternatives(searched, profile, tmp_path):
    first, second = searched.strategy, searched.alternatives[0].strategy
    trials = (T(first.name, searched.prediction.step_time_s, None, "rank 0 failed: RuntimeError: boom"),
              T(second.name, searched.alternatives[0].step_time_s, 0.0185))
    chosen = V.candidate_plan(searched, second, profile)
    new = V.with_choice(searched, trials, chosen, profile)
    # the search's estimate of that strategy (a pure function of the same inputs), every rank listed
    assert new.strategy == second and new.prediction.step_time_s == pytest.approx(searched.alternatives[0].step_time_s)
    assert new.prediction == estimate(second, profile, searched.cluster)
    assert new.stage_ranks == tuple(second.stage_ranks(i) for i in range(second.n_stages))
    r = new.rationale
    assert r.winner_family == second.family and r.summary.startswith(
        f"picked by measurement: {second.summary} ran at 18.5 ms per step here (predicted ")
    assert "the only one of 2 candidates tried that produced a step time" in r.summary
    assert r.lines[0].startswith(f"chosen by measurement: {second.summary}: ")
    assert f"{first.name}: rank 0 failed: RuntimeError: boom" in r.lines[2]
    assert f"the search's comparison, made against its predicted best ({first.summary}):" in r.lines
    # the predicted best is now the first alternative, with its failure; the untried ones are costed against the
    # new choice; the MILP cross-check of the old winner's cut is no longer claimed
    assert new.alternatives[0].strategy == first
    assert new.alternatives[0].lost_because == "failed in its trial: rank 0 failed: RuntimeError: boom"
    assert [a.strategy for a in new.alternatives[1:]] == [a.strategy for a in searched.alternatives[1:]]
    assert all(a.lost_because.startswith(("+", "ties on")) for a in new.alternatives[1:])
    assert new.provenance.milp_status == "not run: chosen by measurement (--verify)"
    assert new.trials == trials
    loaded = Plan.load(new.save(tmp_path / "plan.json"))   # check_plan: a plan `planner run` accepts
    assert loaded == new
    md = render_markdown(loaded)
    assert "## Verified" in md and f"Chosen by measurement: {second.name} in place of the predicted best" in md
    assert f"| {second.name} | " in md and "| 18.5 ms | " in md and "| chosen |" in md


def test_a_confirmed_choice_keeps_its_rationale_and_says_it_was_measured(searched, profile):
    s, alt = searched.strategy, searched.alternatives[0]
    trials = (T(s.name, searched.prediction.step_time_s, 0.010), T(alt.strategy.name, alt.step_time_s, 0.0101))
    new = V.with_choice(searched, trials, V.candidate_plan(searched, s, profile), profile)
    assert new.strategy == s and new.prediction == searched.prediction
    assert new.rationale.summary == searched.rationale.summary
    assert new.rationale.lines[2].startswith("verified by measurement: the predicted best ran at 10.0 ms per step "
                                             "here, the fastest of 2 candidates tried")
    assert new.alternatives[0].lost_because.startswith("measured 10.1 ms per step in its trial against 10.0 ms")
    assert new.alternatives[1:] == searched.alternatives[1:]
    assert [row[-1] for row in trial_rows(new)] == ["chosen", "slower"]
    assert "The predicted best was kept: no other candidate ran more than 1% faster." in render_markdown(new)


def test_trial_verdicts_and_ratio():
    from dataclasses import replace
    plan = SimpleNamespace(strategy=SimpleNamespace(name="b"), trials=(
        T("a", 0.010, 0.0202), T("b", 0.011, 0.0200), T("c", 0.012, 0.0199), T("d", 0.013, None, "hang: x"),
        replace(T("e", 0.014, None), failure="not run: too big")))
    rows = trial_rows(plan)
    assert rows[0] == ["a", "10.0 ms", "20.2 ms", "2.02", "slower"]
    assert rows[1][-1] == "chosen" and rows[2][-1] == "as fast within 1%; ranked lower by prediction"
    assert rows[3] == ["d", "13.0 ms", "-", "-", "failed: hang: x"] and rows[4][-1] == "not run: too big"


def test_older_plans_without_trials_load_and_a_plan_must_have_measured_its_choice(searched):
    data = searched.to_dict()
    assert data.pop("trials") == []
    assert Plan.from_dict(data).trials == ()
    from dataclasses import replace

    from cost_models.records.errors import ConfigError
    from planner.plan import check_plan
    bad = replace(searched, trials=(T("someone else", 1.0, 0.01),))
    with pytest.raises(ConfigError, match="trials do not include a measurement of the chosen strategy"):
        check_plan(bad)


# --- the loop, launch replaced -----------------------------------------------------------------------------------

def _fake_launch(fail_first: bool):
    calls = []

    def launch(p, run):
        calls.append((p.strategy.name, run.steps, run.warmup, run.timeout_s))
        if fail_first and len(calls) == 1:
            raise V.ConfigError("rank 1 failed: OutOfMemoryError: out of memory")
        return SimpleNamespace(step_time_s={"median_s": 0.05 - 0.01 * len(calls)})
    return launch, calls


def test_verify_runs_k_hostable_candidates_in_predicted_order_and_reports_each(searched, profile, monkeypatch):
    launch, calls = _fake_launch(fail_first=True)
    monkeypatch.setattr(V, "launch", launch)
    third = searched.alternatives[1].strategy.name
    monkeypatch.setattr(V, "cannot_host", lambda p: "needs 9 GiB, 1 free" if p.strategy.name == third else None)
    seen = []
    new = V.verify(searched, profile, V.VerifyConfig(k=3, steps=2, timeout_s=30),
                   on_trial=lambda i, t: seen.append((i, t.strategy, t.measured_s, t.failure)))
    names = [searched.strategy.name] + [a.strategy.name for a in searched.alternatives]
    # the one this machine cannot host is recorded, not run, and does not count toward K
    assert [c[0] for c in calls] == [names[0], names[1], names[3]]
    assert calls[0][1:] == (2 + V.WARMUP_STEPS, V.WARMUP_STEPS, 7.5)   # warm-up + timed steps; collectives time
    # out at a quarter of the limit
    assert seen == [(0, names[0], None, "rank 1 failed: OutOfMemoryError: out of memory"),
                    (1, names[1], pytest.approx(0.03), None), (2, names[2], None, "not run: needs 9 GiB, 1 free"),
                    (3, names[3], pytest.approx(0.02), None)]
    assert new.strategy.name == names[3] and [t.strategy for t in new.trials] == names[:4]
    assert V.verify(searched, profile, V.VerifyConfig(k=0)) is searched


def test_an_interrupt_while_a_candidate_runs_ends_the_command(searched, profile, monkeypatch):
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    def launch(p, run):
        try:
            raise SignalException("SIGTERM", signal.SIGTERM)
        except SignalException as exc:
            raise RuntimeError("the agent's wrapper") from exc
    monkeypatch.setattr(V, "launch", launch)
    with pytest.raises(RuntimeError):
        V.run_trial(searched, V.VerifyConfig(k=1), index=0)


def test_the_test_hook_injects_a_failure_into_the_named_trial_only(monkeypatch):
    monkeypatch.setenv(V.VERIFY_INJECT_ENV, "1:0:2:kill")
    monkeypatch.delenv(V.INJECT_FAILURE_ENV, raising=False)
    with V._injected(0):
        assert V.INJECT_FAILURE_ENV not in os.environ
    with V._injected(1):
        assert os.environ[V.INJECT_FAILURE_ENV] == "0:2:kill"
    assert V.INJECT_FAILURE_ENV not in os.environ


def test_bad_verify_settings_are_refused_in_one_line_before_the_search():
    from typer.testing import CliRunner

    from cli import app
    result = CliRunner().invoke(app, ["plan", "missing.json", "-B", "8", "--verify", "-1", "-o", "-"])
    assert result.exit_code == 2
    assert "--verify must be >= 0, --verify-steps >= 1 and --verify-timeout > 0" in result.output


# --- the watchdog ------------------------------------------------------------------------------------------------

def _child() -> subprocess.Popen:
    # a stand-in for a rank: its command line names spawn_main, as multiprocessing's spawned children do
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # spawn_main"])


def test_the_watchdog_stops_ranks_that_outlive_the_limit_and_only_those():
    older = _child()
    try:
        with V.Watchdog(0.5) as dog:
            rank = _child()
            assert rank.wait(timeout=30) == -9
        assert dog.fired and older.poll() is None
        with V.Watchdog(30) as calm:
            rank = _child()
        rank.kill()
        rank.wait()
        assert not calm.fired
    finally:
        older.kill()
        older.wait()


# --- for real ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_verify_2_with_the_predicted_best_failing_returns_the_next_and_records_the_failure(profile, tmp_path):
    ProfileFile(model=profile, cluster=preset("dgx-a100")).save(tmp_path / "profile.json")
    predicted = make_plan(profile, preset("dgx-a100"), REQUEST)   # the order the CLI's search finds
    first, second = predicted.strategy.name, predicted.alternatives[0].strategy.name
    # a failed trial whose peer waited out its collective timeout (--verify-timeout / 4 = 150 s) would run past the
    # 140 s limit; both trials normally end in 20-60 s on 2 shared cores
    proc = subprocess.run([sys.executable, "-m", "cli", "plan", "profile.json", "-g", "2", "-B", "8", "--tp", "1",
                           "--precision", "fp32", "--verify", "2", "--verify-steps", "2", "--verify-timeout", "600",
                           "-o", "plan.json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=140,
                          env={**os.environ, "PYTHONPATH": str(ROOT), V.VERIFY_INJECT_ENV: "0:0:0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    t1, t2 = plan["trials"]
    assert (t1["strategy"], t2["strategy"]) == (first, second)
    assert t1["measured_s"] is None and t1["failure"] == ("rank 0 failed: RuntimeError: injected failure at step 0 "
                                                          "(ZEROPIPE_INJECT_FAILURE)")
    assert 0 < t2["measured_s"] < 5 and t2["failure"] is None and t2["steps"] == 2
    assert plan["strategy"] == predicted.alternatives[0].strategy.to_dict()
    assert plan["prediction"]["step_time_s"] == pytest.approx(t2["predicted_s"])
    assert plan["rationale"]["summary"].startswith("picked by measurement: ")
    assert f"verify 1: {first}: rank 0 failed: RuntimeError: injected failure" in proc.stderr
    assert f"verify 2: {second}: measured " in proc.stderr
    assert "verified on this machine (--verify)" in proc.stdout and "## Verified" in (tmp_path / "report.md").read_text()
