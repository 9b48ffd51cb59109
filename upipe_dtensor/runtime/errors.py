"""How a command ends: run-time outcomes reported in one line instead of a traceback, and the
one ladder from outcome to exit code that every command (train.py, evaluate, convert, plan) uses.

``ConfigError`` covers what the user wrote; ``JobError``, ``JobComplete`` and ``JobStopped`` cover
what the run found (all four live in the leaf ``upipe_dtensor.errors`` and are re-exported here).
Exit codes: 0 done (or nothing left to do); 1 a run-time failure explained in one line; 2 a
configuration error; 128 + N stopped by signal N (after saving a snapshot, for a training job
stopped between steps; 130 for Ctrl-C).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as dist

from upipe_dtensor.errors import ConfigError, JobComplete, JobError, JobStopped

__all__ = [
    "ConfigError",
    "JobComplete",
    "JobError",
    "JobStopped",
    "end_process",
    "report_outcome",
    "run_main",
]


def report_outcome(message: str, code: int) -> int:
    """Rank 0 prints a job-level outcome (every rank reaches the same one) and every rank returns
    ``code``. torchrun stops all ranks as soon as one exits non-zero, so the others wait a moment
    first: rank 0 must not be stopped before it has printed why."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    elif code != 0:
        time.sleep(1.0)
    return code


def run_main(work: Callable[[], object]) -> int:
    """Run a command's ``work`` and return its exit code: 0 when it returns, else the code of the
    outcome it raised, printed in one line by rank 0 (``report_outcome``). The process group, if
    the work made one, is destroyed either way."""
    try:
        work()
    except ConfigError as err:
        return report_outcome(f"config error: {err}", 2)
    except JobComplete as done:
        return report_outcome(str(done), 0)
    except JobError as err:
        return report_outcome(f"error: {err}", 1)
    except JobStopped as stopped:
        return report_outcome(str(stopped), 128 + stopped.signum)
    except KeyboardInterrupt:  # Ctrl-C outside a training loop: one line, not a traceback per rank
        return report_outcome(
            "stopped by Ctrl-C (SIGINT) before the work was done; outputs are written under "
            "temporary names until complete, so nothing half-written was left",
            128 + signal.SIGINT,
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def end_process(code: int) -> NoReturn:
    """End the process with ``code`` once its work is done, skipping interpreter shutdown.

    ``destroy_process_group`` does not stop gloo's threads while torch still holds the group
    (FSDP2 and DTensor keep DeviceMeshes in DTensor's sharding caches), so they run on into
    interpreter shutdown. A gloo thread that needs the GIL then is ended by CPython through C++
    noexcept frames ("terminate called without an active exception"): the rank dies of SIGABRT
    instead of exiting with its own code (tests/test_harness.py reproduces it). Every entry point
    that runs ranks ends through here: train.py, evaluate, convert, the test harness and the
    benchmarks.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
