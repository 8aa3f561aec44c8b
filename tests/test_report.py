"""Reports: content equal to the plan's numbers, SVG for every rank and micro-batch, and a real browser render."""
import re
import shutil
import subprocess

import pytest
from typer.testing import CliRunner

from cli import app
from cost_models.model_profiler import profile_model
from cost_models.models.source import resolve
from cost_models.strategy import Strategy
from cost_models.summaries import duration
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
    assert f"{max(m.total_bytes for m in est.memory_per_rank) / 2**30:.2f} GiB" in page
    assert f"{est.comm.p2p_bytes_per_step / 2**20:,.2f} MiB per step" in page
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
    from cost_models.fileio import dumps, write_atomic
    from executor.launch import summarize
    from executor.train import RankResult
    ranks = [RankResult(rank=r, pp_rank=r // 2, dp_rank=r % 2, stages=(r // 2,), step_times_s=(0.2, 0.1, 0.1),
                        losses=(6.2, 6.1, 6.0), parameter_bytes=m.parameters, gradient_bytes=m.gradients,
                        optimizer_state_bytes=m.optimizer_states, peak_memory_bytes=m.total_bytes * 2,
                        peak_memory_source="test", comm_bytes={}, comm_calls={})
             for r, m in enumerate(plan.prediction.memory_per_rank)]
    run = summarize(plan, ranks, steps=3, warmup=1, backend="gloo")
    run_path = write_atomic(tmp_path / "run.json", dumps(run.to_dict()))
    res = CliRunner().invoke(app, ["report", str(path), "--run", str(run_path), "-o", str(tmp_path / "report.html")])
    assert res.exit_code == 0, res.output
    page = (tmp_path / "report.html").read_text()
    assert "Predicted vs measured" in page and "+100.0%" in page          # peak total measured at twice predicted
    assert (tmp_path / "report.md").read_text().count("| rank ") >= 16
    res = CliRunner().invoke(app, ["report", str(path), "-o", str(tmp_path / "report.html")])
    assert res.exit_code == 2 and "--force" in res.stderr


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
