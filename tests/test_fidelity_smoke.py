"""The fidelity harness end to end in its quick form (2 ranks, one model): checks the harness, not the figures."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from fidelity import kendall_tau  # noqa: E402


def test_kendall_tau():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    assert kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / 6 ** 0.5)   # tau-b with a tie


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def _tau_b(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b as the textbook writes it, (sum of sign products) / sqrt((n0 - n1) (n0 - n2)) with n1, n2
    the pairs tied in x, in y: a second implementation to check the harness's against."""
    pairs = [(i, j) for i in range(len(xs)) for j in range(i + 1, len(xs))]
    s = sum(_sign(xs[i] - xs[j]) * _sign(ys[i] - ys[j]) for i, j in pairs)
    n1 = sum(xs[i] == xs[j] for i, j in pairs)
    n2 = sum(ys[i] == ys[j] for i, j in pairs)
    return s / ((len(pairs) - n1) * (len(pairs) - n2)) ** 0.5


def test_tau_b_of_the_check_agrees_with_the_harness_on_ties():
    xs, ys = [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]
    assert _tau_b(xs, ys) == pytest.approx(kendall_tau(xs, ys))


@pytest.mark.slow
def test_quick_fidelity_run(tmp_path):
    # one launch over the candidates (the benchmark's second, reversed pass measures noise, which this does not check)
    proc = subprocess.run([sys.executable, "benchmarks/fidelity.py", "--quick", "--steps", "2", "--passes", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "fidelity-quick.json").read_text())
    assert data["kind"] == "zeropipe.benchmark.fidelity" and data["quick"] is True
    (config,) = data["configs"]
    assert config["gpus"] == 2 and config["candidates"] == len(config["rows"]) > 10
    # the summary figures, recomputed here from the rows with the textbook formulas
    pred, meas = [r["predicted_s"] for r in config["rows"]], [r["measured_s"] for r in config["rows"]]
    assert config["kendall_tau"] == pytest.approx(_tau_b(pred, meas))
    assert config["mape"] == pytest.approx(sum(abs(p - m) / m for p, m in zip(pred, meas)) / len(meas))
    chosen = min(config["rows"], key=lambda r: (r["predicted_s"], r["strategy"]))
    assert config["choice"] == chosen["strategy"] and config["regret"] == pytest.approx(chosen["measured_s"] / min(meas))
    top3 = sorted(config["rows"], key=lambda r: (r["predicted_s"], r["strategy"]))[:3]
    assert config["regret_verify3"] == pytest.approx(min(r["measured_s"] for r in top3) / min(meas))
    assert 1.0 <= config["regret_verify3"] <= config["regret"]
    for row in config["rows"]:
        assert row["measured_s"] > 0 and row["predicted_s"] > 0
        assert set(row["predicted"]) == set(row["measured"]) == {"compute", "optimizer", "rest"}
    # parameters, gradients and optimizer states are counted, not timed: the memory model must be exact here;
    # activations (executor.activations, every schedule including the split-backward ones) within the 10% target
    errors = data["summary"]["memory_error_max"]
    assert all(errors[k] < 0.05 for k in ("parameters", "gradients", "optimizer_states"))
    assert 0 <= errors["activations"] <= 0.10
    md = (tmp_path / "fidelity-quick.md").read_text()
    assert "| mlp-deep | 2 | 8 |" in md and "Summary: regret max" in md
