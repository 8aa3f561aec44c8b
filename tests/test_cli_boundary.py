"""The CLI's one error boundary and its options declared once."""
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app

ROOT = Path(__file__).resolve().parents[1]


def test_an_error_is_one_line_and_zeropipe_debug_adds_the_traceback(tmp_path):
    missing = str(tmp_path / "nope.json")
    plain = CliRunner().invoke(app, ["report", missing], env={"ZEROPIPE_DEBUG": ""})
    assert plain.exit_code == 2
    assert plain.stderr.strip().splitlines() == [plain.stderr.strip()] and plain.stderr.startswith("error: ")
    debug = CliRunner().invoke(app, ["report", missing], env={"ZEROPIPE_DEBUG": "1"})
    assert debug.exit_code == 2
    lines = debug.stderr.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):" and lines[-1] == plain.stderr.strip()
    assert any("FileFormatError" in line or "Error" in line for line in lines[1:-1])


def test_every_command_goes_through_the_boundary_and_shared_options_are_declared_once():
    source = (ROOT / "cli.py").read_text()
    assert "handles_errors" not in source
    for flag in ("--force", "--json", "--nodes", "--precision", "--optimizer", "--top-k", "--time-limit"):
        assert len(re.findall(rf'typer\.Option\([^)]*"{flag}"', source)) == 1, flag


def test_a_signal_hidden_behind_another_exception_is_still_an_interruption():
    """torch elastic's metrics wrapper turns a SIGTERM that lands before its start time into UnboundLocalError whose
    context is the signal (seen in CI): the boundary still says 'interrupted'; an unrelated error is not."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from cost_models.records.errors import interrupted as _interrupted

    def raised(inner: BaseException) -> BaseException:
        try:
            try:
                raise inner
            finally:
                raise UnboundLocalError("cannot access local variable 'start'")
        except BaseException as exc:
            return exc

    assert _interrupted(raised(SignalException("stop", signal.SIGTERM)))
    assert _interrupted(raised(KeyboardInterrupt()))
    assert not _interrupted(raised(ValueError("a real bug")))
    assert not _interrupted(UnboundLocalError("no context"))


@pytest.mark.slow
def test_zeropipe_debug_shows_the_failing_rank_s_own_traceback(tmp_path):
    """A rank that fails in the model's forward: one line naming it, and under ZEROPIPE_DEBUG=1 the rank's own
    traceback down to the model's line (not the launcher's)."""
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model
    from cost_models.records.strategy import Strategy
    from tests.plans import plan_file
    prof = profile_model(resolve("tests.custom_models:make_real_only"), micro_batch_size=2, seq_len=8, meta=True)
    units = tuple(u.name for u in prof.units)
    s = Strategy(dp=2, pp=1, zero=0, schedule="1f1b", microbatches=1, micro_batch_size=2, v=1, stages=(units,),
                 precision="fp32", optimizer="adamw")
    path = plan_file(tmp_path, s, prof)
    plain = CliRunner().invoke(app, ["run", str(path), "--steps", "1", "-o", "-"], env={"ZEROPIPE_DEBUG": ""})
    line = "RuntimeError: this model only runs on the meta device"
    assert plain.exit_code == 1 and len(plain.stderr.strip().splitlines()) == 1 and line in plain.stderr
    debug = CliRunner().invoke(app, ["run", str(path), "--steps", "1", "-o", "-"], env={"ZEROPIPE_DEBUG": "1"})
    lines = debug.stderr.strip().splitlines()
    # both ranks fail the same way: either may be the one named first
    same = [re.sub(r"rank \d+", "rank N", t) for t in (lines[-1], plain.stderr.strip())]
    assert lines[0] == "the failing rank's traceback:" and same[0] == same[1]
    assert any('tests/custom_models.py' in ln and "in forward" in ln for ln in lines)


def test_ctrl_c_while_typer_parses_the_command_line_still_says_interrupted(monkeypatch, capsys):
    """typer turns a KeyboardInterrupt during its command-line parsing into a silent exit 130 (typer/core.py,
    _main); main() says "interrupted" then, once, as the commands' boundary does."""
    import signal
    import sys

    import cli
    monkeypatch.setattr(signal, "signal", lambda *args: None)   # main()'s SIGTERM handler stays out of pytest

    def swallowed_by_typer():   # what typer does with the Ctrl-C: sys.exit(130), nothing printed
        sys.exit(130)

    def boundary_said_it():     # the commands' boundary printed it and exited 130
        cli._say_interrupted()
        sys.exit(130)
    for app, in ((swallowed_by_typer,), (boundary_said_it,)):
        monkeypatch.setattr(cli, "app", app)
        monkeypatch.setattr(cli, "_INTERRUPT_SAID", [])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
        assert exit_info.value.code == 130 and capsys.readouterr().err == "interrupted\n"
