"""One formatting module for every printed time, size and rate: adaptive units, so nothing prints as 0.0 ms."""
import dataclasses
import re

import pytest

from cost_models.cost.estimate import estimate
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.formatting import about, duration, fixed, flop_rate, load_line, measured, rate, size
from cost_models.records.presets import preset
from cost_models.records.strategy import Strategy
from planner.summaries import estimate_lines, unit_rows
from tests.plans import GPT_TINY_UNITS, plan_for

ZERO_MS = re.compile(r"(?<![\d.])0\.0+ ms")   # "0.0 ms", "0.00 ms", "0.000 ms": what tiny times printed as


@pytest.mark.parametrize("seconds, text", [
    (2.5e-5, "25.0 µs"), (0.0123, "12.3 ms"), (1.5, "1.50 s"), (2.2e-8, "22.0 ns"), (2.2e-14, "2.2e-14 s"),
    (1.23456e-5, "12.3 µs"), (9.9996e-5, "0.100 ms"), (0.00012345, "0.123 ms"), (0.34158, "342 ms"),
    (0.99996, "1.00 s"), (12.345, "12.3 s"), (1234.5, "1,230 s"), (0.0, "0 ms"), (-0.002, "-2.00 ms"),
])
def test_duration_switches_to_microseconds_below_a_tenth_of_a_millisecond(seconds, text):
    assert duration(seconds) == text


def test_a_40_microsecond_step_is_not_zero_milliseconds():
    assert duration(4e-5) == "40.0 µs" and duration(4e-5, digits=6) == "40.0000 µs"
    assert duration(0.0123456789, digits=6) == "12.3457 ms"


@pytest.mark.parametrize("seconds, text", [
    (40, "about 40 s"), (89, "about 89 s"), (90, "about 2 min"), (700, "about 12 min"), (5399, "about 90 min"),
    (5400, "about 1.5 h"), (9000, "about 2.5 h"),
])
def test_about_goes_from_seconds_to_minutes_to_hours(seconds, text):
    assert about(seconds) == text


@pytest.mark.parametrize("n_bytes, text", [
    (0, "0 B"), (5, "5 B"), (1023, "1,023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"), (40 * 2**10, "40.0 KiB"),
    (2**20 - 0.1, "1.00 MiB"), (12.34 * 2**20, "12.3 MiB"), (2**30, "1.00 GiB"), (80 * 2**30, "80.0 GiB"),
    (1234 * 2**30, "1,230 GiB"), (-3 * 2**20, "-3.00 MiB"),
])
def test_size_picks_the_unit_that_keeps_three_digits(n_bytes, text):
    assert size(n_bytes) == text


def test_rates_use_decimal_units():
    assert rate(25e9) == "25.0 GB/s" and rate(9e8) == "900 MB/s" and rate(1.5e3) == "1.50 kB/s"
    assert flop_rate(989e12) == "989 TFLOP/s" and flop_rate(2.4e8) == "240 MFLOP/s"


def test_fixed_keeps_the_unit_a_column_header_names():
    assert fixed(3 * 2**30, "GiB", 3, show_unit=False) == "3.000"
    assert fixed(50 * 2**10, "GiB") == "0.00 GiB"          # a fixed unit can print 0: for columns, not for prose
    assert fixed(1234.5 * 2**20, "MiB", 3) == "1,234.500 MiB"
    assert fixed(989.4e12, "TFLOP/s", 0, show_unit=False) == "989"


def test_measured_values_print_by_their_unit():
    assert measured(2.5e-5, "s") == "25.0 µs"
    assert measured(3 * 2**20, "B") == "3.000 MiB"
    with pytest.raises(ValueError):
        measured(1.0, "GiB")


@pytest.fixture(scope="module")
def tiny_step():
    """gpt-tiny on one H100, priced by FLOPs alone (its work by kind dropped, as in older profiles; the kernels'
    launch gaps would add their own microseconds): a step of about 2 µs."""
    counted = profile_model(resolve("gpt-tiny"), micro_batch_size=1, seq_len=16, meta=True, dtype="fp32")
    prof = dataclasses.replace(counted, units=tuple(dataclasses.replace(u, fwd_work=None, bwd_work=None)
                                                    for u in counted.units))
    s = Strategy(dp=1, pp=1, zero=0, schedule="1f1b", microbatches=1, micro_batch_size=1, stages=(GPT_TINY_UNITS,))
    return s, prof, preset("dgx-h100")


def test_estimate_lines_print_microsecond_steps(tiny_step):
    s, prof, cluster = tiny_step
    est = estimate(s, prof, cluster)
    assert est.step_time_s < 1e-4
    lines = estimate_lines(s, est)
    assert lines[1].startswith(f"step time: {duration(est.step_time_s)} = compute {duration(est.breakdown.compute_s)}")
    assert " µs" in lines[1] and not any(ZERO_MS.search(line) for line in lines)


def test_report_prints_microsecond_steps(tiny_step):
    from planner.report import render_html, render_markdown
    s, prof, cluster = tiny_step
    plan = plan_for(s, prof, cluster=cluster)
    md, page = render_markdown(plan), render_html(plan)
    assert f"Predicted step time {duration(plan.prediction.step_time_s)};" in md
    assert "µs" in md and not ZERO_MS.search(md) and not ZERO_MS.search(page)


def test_unit_table_prints_measured_times_with_their_unit(tiny_profiles):
    prof = tiny_profiles["gpt-tiny", False]
    rows = unit_rows(prof)
    for u, row in zip(prof.units, rows):
        assert row[6:] == [duration(u.fwd_time.median_s), duration(u.bwd_time.median_s)]
    assert rows[-1][6] == duration(sum(u.fwd_time.median_s for u in prof.units))
    assert all(re.fullmatch(r"[\d.,]+ (µs|ms|s)", cell) for row in rows for cell in row[6:])


def test_the_load_line_says_whether_ranks_waited_for_a_core():
    busy = load_line((1.5, 4.25), 2, 4)
    assert busy.startswith("machine load during the run (1-minute average): 1.5 to 4.2 on 2 CPUs with 4 ranks; ")
    assert busy.endswith("measured times include waiting for a core")
    assert load_line((0.3, 1.9), 2, 2).endswith("below the CPU count: the measured times are the plan's own")
