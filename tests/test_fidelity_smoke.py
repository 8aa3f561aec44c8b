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


@pytest.mark.slow
def test_quick_fidelity_run(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/fidelity.py", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "fidelity-quick.json").read_text())
    assert data["kind"] == "zeropipe.benchmark.fidelity" and data["quick"] is True
    (config,) = data["configs"]
    assert config["gpus"] == 2 and config["candidates"] == len(config["rows"]) > 10
    assert config["regret"] >= 1.0 and -1.0 <= config["kendall_tau"] <= 1.0 and config["mape"] >= 0
    for row in config["rows"]:
        assert row["measured_s"] > 0 and row["predicted_s"] > 0
        assert set(row["predicted"]) == set(row["measured"]) == {"compute", "optimizer", "rest"}
    # parameters, gradients and optimizer states are counted, not timed: the memory model must be exact here
    assert all(v < 0.05 for v in data["summary"]["memory_error_max"].values())
    md = (tmp_path / "fidelity-quick.md").read_text()
    assert "| mlp-deep | 2 | 8 |" in md and "Summary: regret max" in md
