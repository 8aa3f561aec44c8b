"""Reports: content equal to the plan's numbers, SVG for every rank and micro-batch, and a real browser render."""
import re
import shutil
import subprocess

import pytest
from typer.testing import CliRunner

from cli import app
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.formatting import duration, fixed, size
from cost_models.records.strategy import Strategy
from planner.report import render_html, render_markdown
from tests.plans import GPT_TINY_UNITS, plan_file, plan_for


@pytest.fixture(scope="module")
def pipeline_plan():
    prof = profile_model(resolve("gpt-tiny"), micro_batch_size=1, seq_len=16, meta=True, dtype="fp32")
    s = Strategy(dp=2, pp=2, zero=1, schedule="1f1b", microbatches=4, micro_batch_size=1,
                 stages=(GPT_TINY_UNITS[:3], GPT_TINY_UNITS[3:]), precision="fp32")
    return plan_for(s, prof), prof


def test_report_content_matches_the_plan(pipeline_plan):
    plan, _ = pipeline_plan
    page = render_html(plan)
    est = plan.prediction
    assert "2-stage 1f1b x 2-way ZeRO-1, 4 micro-batch(es) of 1" in page
    assert f"Predicted step time {duration(est.step_time_s)}" in page
    assert f"{fixed(max(m.total_bytes for m in est.memory_per_rank), 'GiB')}" in page
    assert f"Pipeline point-to-point: {size(est.comm.p2p_bytes_per_step)} per step" in page
    # the timeline: a forward and a backward block for every (rank, micro-batch)
    for rank in range(2):
        for mb in range(4):
            for kind in ("F", "B"):
                assert re.search(rf'class="act {kind}" data-rank="{rank}" data-stage="{rank}" data-mb="{mb}"', page)
    assert page.count('class="act ') == 16
    # memory bars: one stack per group of identical ranks (the two dp replicas of each pipeline rank)
    assert page.count('class="mem parameters"') == 2 and 'class="capacity"' in page
    assert page.count("<svg") == 3 and "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")
    md = render_markdown(plan)
    assert "## Why: ZeRO or pipeline?" in md and f"{duration(est.step_time_s)}" in md


def test_report_cli_with_a_run(tmp_path, pipeline_plan):
    plan, prof = pipeline_plan
    path = plan_file(tmp_path, plan.strategy, prof)
    from executor.launch import summarize
    from planner.run_record import RankResult
    ranks = [RankResult(rank=r, pp_rank=r // 2, dp_rank=r % 2, stages=(r // 2,), step_times_s=(0.2, 0.1, 0.1),
                        losses=(6.2, 6.1, 6.0), parameter_bytes=m.parameters, gradient_bytes=m.gradients,
                        optimizer_state_bytes=m.optimizer_states, peak_memory_bytes=m.total_bytes * 2,
                        peak_memory_source="test", comm_bytes={}, comm_calls={})
             for r, m in enumerate(plan.prediction.memory_per_rank)]
    run = summarize(plan, ranks, steps=3, warmup=1, backend="gloo")
    run_path = run.save(tmp_path / "run.json")
    res = CliRunner().invoke(app, ["report", str(path), "--run", str(run_path), "-o", str(tmp_path / "report.html")])
    assert res.exit_code == 0, res.output
    page = (tmp_path / "report.html").read_text()
    assert "Predicted vs measured" in page and "+100.0%" in page          # peak total measured at twice predicted
    assert (tmp_path / "report.md").read_text().count("| rank ") >= 16
    res = CliRunner().invoke(app, ["report", str(path), "-o", str(tmp_path / "report.html")])
    assert res.exit_code == 2 and "--force" in res.stderr


def _run_of(plan, measures):
    from planner.run_record import RunFile
    return RunFile(model=plan.model.name, strategy_summary=plan.strategy.summary, world_size=plan.gpus, steps=3,
                   warmup=1, backend="gloo", losses=(6.2, 6.1, 6.0), step_time_s={"median_s": 4e-5},
                   tokens_per_s=1.0, predicted_step_time_s=plan.prediction.step_time_s, ranks=(),
                   measures=tuple(measures), created_at="")


def test_the_run_section_renders_typed_rows_with_their_units(pipeline_plan):
    from planner.report import MEASURE_COLUMNS, measure_rows
    from planner.run_record import Measure
    plan, _ = pipeline_plan
    run = _run_of(plan, [Measure(quantity="step time", unit="s", predicted=5e-5, measured=4e-5),
                         Measure(quantity="rank 1 parameters", unit="B", predicted=2 * 2**20, measured=3 * 2**20),
                         Measure(quantity="p2p bytes per step (one pipeline)", unit="B", predicted=0, measured=10)])
    assert measure_rows(run) == [["step time", "50.0 µs", "40.0 µs", "-20.0%"],
                                 ["rank 1 parameters", "2.000 MiB", "3.000 MiB", "+50.0%"],
                                 ["p2p bytes per step (one pipeline)", "0.000 MiB", "0.000 MiB", "-"]]
    md = render_markdown(plan, run)
    assert "| " + " | ".join(MEASURE_COLUMNS) + " |" in md
    assert "| step time | 50.0 µs | 40.0 µs | -20.0% |" in md and "measured median step 40.0 µs" in md


def test_a_run_json_of_the_old_format_is_refused_saying_to_re_run(tmp_path, pipeline_plan):
    import json

    from cost_models.records.errors import FileFormatError
    from planner.run_record import load_run
    plan, _ = pipeline_plan
    data = _run_of(plan, []).to_dict()
    data.update(schema_version=1, comparisons=[{"quantity": "step time (s)", "predicted": 1.0, "measured": 1.0,
                                                 "error_pct": 0.0}])
    (tmp_path / "run.json").write_text(json.dumps(data))
    with pytest.raises(FileFormatError) as exc:
        load_run(tmp_path / "run.json", plan)
    assert str(exc.value) == (f"{tmp_path / 'run.json'}: schema_version 1, this zeropipe reads 2; "
                              f"re-run planner run to write it again")


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed (apt-get install chromium)")
def test_report_renders_in_headless_chromium_without_console_errors(tmp_path, pipeline_plan):
    plan, _ = pipeline_plan
    page = tmp_path / "report.html"
    page.write_text(render_html(plan))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0"]
    proc = subprocess.run(["chromium", *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "<svg" in proc.stdout and 'class="act F"' in proc.stdout     # the DOM has the pictures
    console = [l for l in proc.stderr.splitlines() if "CONSOLE" in l or "Uncaught" in l]
    assert console == []
    shot = tmp_path / "shot.png"
    subprocess.run(["chromium", *flags, "--window-size=1100,2000", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, text=True, timeout=120)
    assert shot.stat().st_size > 10_000


def _with_candidates(plan, times_s, mems_gib):
    import dataclasses

    from planner.plan import Candidate
    cands = tuple(Candidate(label=f"c{i}", family="zero", step_time_s=t, peak_memory_bytes=int(m * 2**30), fits=True)
                  for i, (t, m) in enumerate(zip(times_s, mems_gib)))
    return dataclasses.replace(plan, candidates=cands)


def _candidate_xy(svg: str) -> dict[str, tuple[float, float]]:
    return {m[3]: (float(m[1]), float(m[2])) for m in
            re.finditer(r'<circle class="cand fits [a-z]+" cx="([-\d.]+)" cy="([-\d.]+)"[^>]*><title>(c\d+):', svg)}


def test_candidates_chart_spreads_a_100x_range_over_log_axes(pipeline_plan):
    from planner.report import candidates_svg
    plan, _ = pipeline_plan
    # 10 ms, 100 ms, 1 s: on a linear axis the first two sit within 9% of the width of each other
    svg = candidates_svg(_with_candidates(plan, [0.01, 0.1, 1.0], [0.5, 5.0, 50.0]), width=960)
    xy = _candidate_xy(svg)
    plot_width = 960 - 70 - 20
    assert xy["c2"][0] - xy["c0"][0] > plot_width / 2
    assert xy["c1"][0] - xy["c0"][0] > plot_width / 3                 # each decade gets the same share
    assert abs((xy["c1"][0] - xy["c0"][0]) - (xy["c2"][0] - xy["c1"][0])) < 0.5
    # memory spans 100x too (capacity 80 GiB included): log there as well, decades equally spaced
    assert abs((xy["c0"][1] - xy["c1"][1]) - (xy["c1"][1] - xy["c2"][1])) < 0.5
    ticks = re.findall(r'<text class="tick x"[^>]*>([^<]+)</text>', svg)
    assert ticks == ["10 ms", "20 ms", "50 ms", "100 ms", "200 ms", "500 ms", "1 s"]
    assert re.findall(r'<text class="tick y"[^>]*>([^<]+)</text>', svg) == \
        ["0.5", "1", "2", "5", "10", "20", "50", "100"]   # up to the 80 GiB capacity
    # memory within a decade of the capacity stays linear
    capacity_gib = plan.prediction.capacity_bytes / 2**30
    svg = candidates_svg(_with_candidates(plan, [0.02, 0.03], [capacity_gib / 2, capacity_gib / 4]))
    xy = _candidate_xy(svg)
    bottom = 320 - 40
    # linear from zero: half the capacity sits twice as high above the axis as a quarter of it
    assert (bottom - xy["c0"][1]) == pytest.approx(2 * (bottom - xy["c1"][1]), abs=0.02)
    assert "GiB (log)" not in svg


@pytest.mark.parametrize("profile_dtype, precision, warned", [("bf16", "fp32", False), ("fp32", "bf16-mixed", True),
                                                              ("bf16", "bf16-mixed", None)])
def test_memory_says_how_activations_were_scaled_from_a_profile_in_another_dtype(profile_dtype, precision, warned):
    """The report's memory section names the profile's dtype and the bytes that kept their size; from fp32 to bf16
    it says what the profile cannot see (a bf16 run's fp32 statistics) and how to get exact activations."""
    from cost_models.records.presets import preset
    from planner.request import PlanRequest
    from planner.search import plan as make_plan
    prof = profile_model(resolve("gpt-tiny"), micro_batch_size=2, seq_len=16, meta=True, dtype=profile_dtype)
    page = render_markdown(make_plan(prof, preset("dgx-a100"), PlanRequest(gpus=2, global_batch_size=8,
                                                                            precision=precision)))
    other = sum(u.saved_other_dtype_bytes for u in prof.units)
    if warned is None:
        assert "Activations are scaled" not in page
        return
    assert f"Activations are scaled from {'an' if profile_dtype == 'fp32' else 'a'} {profile_dtype} profile" in page
    assert f"the {size(other)} its units save in other dtypes" in page and other > 0
    assert ("for exact activations" in page) == warned


def test_the_report_says_under_what_load_the_profile_was_timed_and_the_run_measured(pipeline_plan):
    """A real profile timed on a loaded machine, and what the profiler did about it, reach the report through the
    plan's provenance; a run's load during its steps is beside its measurements. A meta profile has neither."""
    import dataclasses

    from planner.summaries import profile_conditions
    plan, prof = pipeline_plan
    assert profile_conditions(prof) == () and "Profile:" not in render_markdown(plan)
    loaded = dataclasses.replace(prof, load_1min=(4.2, 4.5), cpus=2, timing_notes=("4 identical units (...) pooled",))
    conditions = profile_conditions(loaded)
    assert len(conditions) == 2 and "4.2 to 4.5 on 2 CPUs; more runnable work than CPUs" in conditions[0]
    noted = dataclasses.replace(plan, provenance=dataclasses.replace(plan.provenance, profile_conditions=conditions))
    run = dataclasses.replace(_run_of(plan, []), load_1min=(4.3, 4.4), cpus=2)
    md = render_markdown(noted, run)
    assert f"- Profile: {conditions[0]}." in md and "- Profile: 4 identical units (...) pooled." in md
    assert "machine load during the run (1-minute average): 4.3 to 4.4 on 2 CPUs with 4 ranks" in md


def test_the_report_names_other_programs_beside_the_cluster_probe_and_how_they_are_priced(pipeline_plan):
    """A probe of CPU ranks that saw other programs' runnable tasks prices them as sharing the cores
    (cost.sharing.effective_cores); the report's summary says how many and each rank's share with all computing.
    4 ranks that get 2 cores' worth alone, beside 2 other tasks on a 2-core host: 4 / (4 + 2) x 2 cores = 1.33 cores
    for 4 ranks, 33% each. Nothing is said without them."""
    import dataclasses

    from planner.summaries import cluster_lines
    from tests.clusters import cpu_cluster
    plan, _ = pipeline_plan
    quiet = cpu_cluster(ranks=4, cores=2)
    compute = dataclasses.replace(quiet.compute, background_runnable=2.0, host_cores=2)
    busy = dataclasses.replace(quiet, compute=compute)
    line = ("- Cluster: 2 runnable task(s) of other programs beside the cluster probe, priced as sharing the cores "
            "with the ranks: with all 4 ranks computing, each at 33% of its speed alone.")
    assert line in render_markdown(dataclasses.replace(plan, cluster=busy))
    assert "- Cluster:" not in render_markdown(dataclasses.replace(plan, cluster=quiet))
    # and `planner profile` prints it among the cluster's notes
    assert cluster_lines(busy)[-1] == "note: " + line.removeprefix("- Cluster: ").removesuffix(".")
    assert not any("other programs" in x for x in cluster_lines(quiet))
