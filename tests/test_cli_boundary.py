"""The CLI's one error boundary and its options declared once."""
import re
from pathlib import Path

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
