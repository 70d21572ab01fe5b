"""Typed errors raised by library code; the CLI (`trainbox.cli`) turns each into one short message and an exit code.

Every error carries *what* went wrong (the message, naming the file, key or value) and, where there is
one, *what to do next* (`hint`, usually a command). Library code never prints or exits.
"""
from __future__ import annotations

import importlib.util


class TrainboxError(Exception):
    """Base class. `exit_code` is what the CLI exits with; `hint` is the next step for the user."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  -> {self.hint}"


class ConfigError(TrainboxError):
    """Unknown or mistyped config key, bad value, unknown recipe. Raised before any work starts."""

    exit_code = 2


class DataError(TrainboxError):
    """Missing, corrupt or too-small data (names the file and, where known, the byte offset)."""


class CheckpointError(TrainboxError):
    """Missing or unreadable checkpoint, or a run that cannot be resumed."""


class BadCheckpoint(CheckpointError):
    """A checkpoint given to a command that reads one (export, chat) is missing or fails verification: the command
    is refused before any work, as a usage error."""

    exit_code = 2


class RunBusy(TrainboxError):
    """Another live process holds the run directory; refused before any work."""

    exit_code = 2


class RunFinished(TrainboxError):
    """The run directory already holds a finished run; not a failure."""

    exit_code = 0


class TrainingFailed(TrainboxError):
    """The run stopped on a fault (NaN/inf loss, failed save); the last good checkpoint is kept."""


def require(package: str, extra: str, what: str) -> None:
    """Raise MissingDependency when `package` (of the `extra`) is not installed; `what` names what needs it."""
    if importlib.util.find_spec(package) is None:
        raise MissingDependency(package, extra, what)


class MissingDependency(TrainboxError):
    """An optional extra is needed (transformers, peft, bitsandbytes, wandb, ...)."""

    def __init__(self, package: str, extra: str, what: str, hint: str | None = None):
        super().__init__(f"{what} needs the Python package '{package}', which is not installed",
                         hint=hint or f"pip install 'trainbox[{extra}]'")


class NoData(DataError):
    """The input holds nothing to work on (no documents, no tokens); nothing was written. A usage error."""

    exit_code = 2


class RunNotRunning(TrainboxError):
    """`trainbox stop` of a run with no live process here: stopped, crashed, failed, or on another host."""
