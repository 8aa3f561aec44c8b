"""The bad-input and fault matrix (benchmarks/fault_matrix.py, issue 14's acceptance check) in its --quick form: the
cases that start no ranks. It runs ~110 CLI processes (each imports torch), several minutes on 2 cores: slow."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fault_matrix.py"

# Cases of categories a-c that the tree handles (checked before this test was written): each must keep passing.
KNOWN_FIXED = (
    "plan:profile:truncated",            # (a) a cut-off profile: one "not valid JSON" line
    "run:plan:schema-99",                # (a) a plan from a newer zeropipe, refused before any rank
    "report:plan:zero=7",                # (b) defect 1/11: an impossible ZeRO stage in an edited plan
    "plan:profile:nan-unit-times",       # (c) defect 5: NaN unit times no longer plan a 9.6 ms GPipe
    "profile-cluster:cluster:infinity",  # (c) defect 5: Infinity in a cluster file is refused, not written back
    "profile:output-name-too-long",      # (j) an OSError the system raises: one line, not a traceback
    "profile:tp-plan-function-raises",   # (j) an error in the user's --tp-plan function, named
)


def _matrix():
    spec = importlib.util.spec_from_file_location("fault_matrix", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)   # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quick_matrix_gives_every_case_a_verdict(tmp_path):
    quick = [c.name for c in _matrix().quick_cases()]
    assert set(KNOWN_FIXED) <= set(quick)
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=1150)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "fault-matrix.json").read_text())
    assert result["quick"] is True
    verdicts = {c["name"]: c["verdict"] for c in result["cases"]}
    assert list(verdicts) == quick                      # every quick case, in order, none twice
    assert all(v == "pass" or v.startswith(("fail: ", "skipped: ")) for v in verdicts.values())
    assert not any(c["spawns"] for c in result["cases"])
    for name in KNOWN_FIXED:
        assert verdicts[name] == "pass", (name, verdicts[name])
    # the summary line counts what the cases say
    passed = sum(v == "pass" for v in verdicts.values())
    failed = sum(v.startswith("fail") for v in verdicts.values())
    assert result["summary"].startswith(f"{len(quick)} cases: {passed} passed, {failed} failed")
    assert f"{len(quick)} cases: {passed} passed, {failed} failed" in done.stdout
    assert len(result["load_average_start"]) == 3 and len(result["load_average_end"]) == 3
