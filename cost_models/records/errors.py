"""The PlannerError family: every error a user can cause, each with the exit code the CLI returns.

The message is one line that says what to change; the CLI prints it without a traceback.
"""
from __future__ import annotations


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
