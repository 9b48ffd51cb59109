"""Run-time outcomes that train.py reports in one line instead of a traceback.

``ConfigError`` (in ``config``) covers what the user wrote; these cover what the run found.
"""

from __future__ import annotations


class JobError(RuntimeError):
    """A failure with a known cause; the message names it, what is safe, and what to do."""


class JobComplete(Exception):
    """The newest snapshot already reached ``[training] steps``: there is nothing to train."""


class JobStopped(Exception):
    """SIGTERM or SIGUSR1 stopped the job at a step boundary (after saving, if checkpointing is
    on); train.py exits with 128 + the signal number, as a process killed by it would."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
