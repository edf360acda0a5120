"""Errors that say what went wrong and what to do, and the exit codes of ``src/train.py``.

:class:`BadInputError` marks everything that stops a run *before training*: a config value, a
data file, the state of the run directory. Its message names the value or file and says what to
do; ``src/train.py`` prints it without a traceback and exits with :data:`EXIT_BAD_INPUT`.
:class:`NonFiniteError` is raised by an optimizer that meets a non-finite gradient before it
changes anything; the training loop records it as a divergence. docs/resume.md lists the codes.
"""

from __future__ import annotations

from typing import Any

EXIT_COMPLETED = 0
EXIT_FAILED = 1  # an unexpected error during the run (summary.json: status failed)
EXIT_BAD_INPUT = 2  # stopped before training: config value, data file, run directory
EXIT_DIVERGED = 3  # a non-finite loss or gradient (summary.json: status diverged)
EXIT_SIGINT = 130  # 128 + SIGINT: interrupted (Ctrl-C), checkpoint written, resumable
EXIT_SIGTERM = 143  # 128 + SIGTERM: interrupted (e.g. a scheduler's stop), checkpoint written


class BadInputError(Exception):
    """A run cannot start: the message names the value, file or directory and what to do."""


class ConfigError(BadInputError, ValueError):
    """A config value is of the wrong type or out of range (or a resume changes the run)."""


class RunInUseError(BadInputError, RuntimeError):
    """Another live process owns the run directory."""


class RunExistsError(BadInputError, FileExistsError):
    """The run directory already holds a run and no flag says what to do with it."""


class NoCheckpointError(BadInputError, FileNotFoundError):
    """``trainer.resume=true`` but the run directory has nothing to resume from."""


class CorruptCheckpointError(BadInputError, ValueError):
    """A checkpoint exists but cannot be read, or does not fit this run's model or optimizer."""


class DataNotFoundError(BadInputError, FileNotFoundError):
    """Raised before training when a dataset's files are missing; the message says what to do."""


class CorruptDataError(BadInputError, ValueError):
    """Raised when a data file exists but cannot be read, or its checksum or shape is wrong."""


class NonFiniteError(FloatingPointError):
    """An optimizer met a NaN/inf (gradient, curvature) and left parameters and state unchanged."""


def exit_code(summary: dict[str, Any]) -> int:
    """The process exit code for a run's summary.

    Args:
        summary: The run's ``summary.json`` as a dict; its ``status`` (``completed``,
            ``diverged``, ``interrupted``, anything else = failed) and, for interrupted runs,
            ``stop_reason`` (``sigterm...``, ``paused`` (``trainer.pause_at_step``: 0) or a SIGINT
            reason) decide the code.

    Returns:
        One of :data:`EXIT_COMPLETED`, :data:`EXIT_DIVERGED`, :data:`EXIT_SIGTERM`,
        :data:`EXIT_SIGINT` or :data:`EXIT_FAILED`.
    """
    status = summary.get("status")
    if status == "completed":
        return EXIT_COMPLETED
    if status == "diverged":
        return EXIT_DIVERGED
    if status == "interrupted" and summary.get("stop_reason") == "paused":
        return EXIT_COMPLETED  # trainer.pause_at_step: stopped where the command asked
    if status == "interrupted":
        return EXIT_SIGTERM if str(summary.get("stop_reason")).startswith("sigterm") else EXIT_SIGINT
    return EXIT_FAILED
