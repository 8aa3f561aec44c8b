"""Helpers around torchrun's elastic launcher shared by the cluster probe and the executor."""
from __future__ import annotations

import contextlib
import logging
import re

# Messages a rank raises because another rank died first: never the root cause when a real error exists.
_CONSEQUENCES = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing", "Timed out waiting")


@contextlib.contextmanager
def quiet_elastic_logs():
    """The agent logs multi-line tracebacks of failed workers; callers turn them into one line instead."""
    # torch.multiprocessing.spawn logs "Terminating process N via signal SIGTERM" for every peer the agent stops
    logs = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing.spawn")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def is_consequence(message: str) -> bool:
    return any(c in message for c in _CONSEQUENCES)


def root_failure(exc) -> tuple[int, str]:
    """(rank, first line of its error) of the failure that caused a ChildFailedError: a rank that raised on its
    own rather than one that lost its connection to it; the earliest and lowest rank among equals."""
    candidates = []
    for rank, failure in exc.failures.items():
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
        line = _signal_line(message.strip().splitlines()[0]) if message.strip() else f"exit code {failure.exitcode}"
        consequence = is_consequence(message)
        candidates.append((consequence, failure.timestamp, rank, line))
    _, _, rank, line = min(candidates)
    return rank, line


def _signal_line(line: str) -> str:
    """A rank killed by a signal (kill -9, the OOM killer) leaves no exception, only the agent's record of the
    signal: 'Signal 9 (SIGKILL) received by PID 123' -> 'killed by SIGKILL (signal 9)'."""
    m = re.match(r"Signal (\d+) \((\w+)\) received by PID \d+", line)
    return f"killed by {m.group(2)} (signal {m.group(1)})" if m else line
