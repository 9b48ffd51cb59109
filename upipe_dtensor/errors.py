"""The project's shared exceptions, in a module that imports nothing of the project.

Every layer raises them (the checkpoint writers refuse a folder with a ``ConfigError``, the
runtime turns each into an exit code), so they live below all of them. ``ConfigError`` covers
what the user wrote; ``DoesNotFit`` is the planner's negative answer; the others cover what the
run found. Their documented homes,
``upipe_dtensor.config`` and ``upipe_dtensor.runtime.errors``, re-export them.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A job configuration that cannot run; the message names the source, the key and a fix."""


class JobError(RuntimeError):
    """A failure with a known cause; the message names it, what is safe, and what to do."""


class DoesNotFit(Exception):
    """The planner's answer is "does not fit": the job does not fit its memory budget. An answer,
    not an error, so it has an exit code of its own (3), which a script that books GPUs on the
    planner's word can tell from a mistake (2) or a failure (1); the message says what binds."""


class JobComplete(Exception):
    """The newest snapshot already reached ``[training] steps``: there is nothing to train."""


class JobStopped(Exception):
    """SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) stopped the job at a step boundary (after saving, if
    checkpointing is on); train.py exits with 128 + the signal number, as a process killed by it
    would."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
