"""The PlannerError family: every error a user can cause, each with the exit code the CLI returns.

The message is one line that says what to change; the CLI prints it without a traceback.
"""
from __future__ import annotations

import sys
from typing import Iterator


class PlannerError(Exception):
    """Base of every user-facing error. `exit_code` is what `planner` exits with."""

    exit_code = 2


class ConfigError(PlannerError):
    """A flag, option or value the user gave is invalid."""


class ModelSourceError(ConfigError):
    """The model named by --model cannot be found or built."""


class FileFormatError(ConfigError):
    """A file the user passed (profile, cluster, plan) is unreadable or of the wrong schema."""


class OutputExistsError(ConfigError):
    """Refusing to overwrite a file the user already has."""


class OutputError(ConfigError):
    """An output file cannot be written (read-only or missing folder, a folder in its place, a full disk)."""


class WeightsError(ConfigError):
    """Pretrained weights (--init-from) that cannot be loaded into the model: not a folder of a format we read, or
    saved from another model (a parameter missing, another shape)."""


class ProfileError(PlannerError):
    """Profiling failed for a reason the user can fix (e.g. a model too big for real mode)."""


class InfeasibleError(PlannerError):
    """No strategy fits the memory of the cluster (exit 3, as `planner plan` documents)."""

    exit_code = 3


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc` and what caused it (`__cause__`, else `__context__`), each once: a chain can loop."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def interrupted(exc: BaseException | None) -> bool:
    """Ctrl-C or SIGTERM anywhere in the chain: KeyboardInterrupt (the CLI installs the SIGTERM handler), or torch
    elastic's SignalException while ranks run (its agent installs its own handlers, stops every rank, then raises
    it). The signal can land inside torch's metrics wrapper before it records its start time; the wrapper's
    `finally` then raises UnboundLocalError with the signal as its context, so the whole chain is searched. The
    elastic module is looked up, not imported: where it was never imported, no SignalException was raised."""
    elastic = sys.modules.get("torch.distributed.elastic.multiprocessing.api")
    signals = (KeyboardInterrupt,) + ((elastic.SignalException,) if elastic is not None else ())
    return any(isinstance(link, signals) for link in exception_chain(exc))
