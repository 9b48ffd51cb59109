"""Run-time outcomes that train.py reports in one line instead of a traceback.

``ConfigError`` (in ``config``) covers what the user wrote; these cover what the run found.
"""

from __future__ import annotations

import os
import sys
import time


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


def report_outcome(message: str, code: int) -> int:
    """Rank 0 prints a job-level outcome (every rank reaches the same one) and every rank returns
    ``code``. torchrun stops all ranks as soon as one exits non-zero, so the others wait a moment
    first: rank 0 must not be stopped before it has printed why."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    elif code != 0:
        time.sleep(1.0)
    return code
