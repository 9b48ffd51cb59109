"""How a command ends: run-time outcomes reported in one line instead of a traceback, and the
one ladder from outcome to exit code that every command (train.py, evaluate, convert, plan) uses.

``ConfigError`` covers what the user wrote; ``JobError``, ``JobComplete`` and ``JobStopped`` cover
what the run found; ``DoesNotFit`` is the planner's answer "does not fit" (all five live in the
leaf ``upipe_dtensor.errors`` and are re-exported here). Exit codes: 0 done (or nothing left to
do); 1 a run-time failure explained in one line; 2 a configuration error; 3 the planner's
answer "does not fit" (``DOES_NOT_FIT``); 128 + N stopped by signal N (after saving a snapshot,
for a training job stopped between steps; 130 for Ctrl-C).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

from upipe_dtensor.errors import ConfigError, DoesNotFit, JobComplete, JobError, JobStopped
from upipe_dtensor.runtime.logs import set_up_logging

__all__ = [
    "DOES_NOT_FIT",
    "ConfigError",
    "DoesNotFit",
    "JobComplete",
    "JobError",
    "JobStopped",
    "end_process",
    "report_outcome",
    "run_main",
    "say_outcome",
]


DOES_NOT_FIT = 3
"""The exit code of the planner's answer "does not fit" (``DoesNotFit``): not 0, so a script that
books GPUs on the plan cannot take it for "fits"; not 1 or 2, so it cannot take it for a
failure or a mistake in the job."""

OUTCOME_WAIT = timedelta(seconds=60)
"""How long a rank waits for the rank that prints a failure it also reached, and for torchrun's
store to answer; past it (that rank died first, the store is gone) it prints the line itself."""


def say_outcome(message: str) -> None:
    """The line that says why a command ends, on stderr. Printed, not logged: it is the command's
    last word beside its exit code, which no log level or handler setting may hide
    (``runtime.logs``); every outcome line of the package goes through here."""
    print(message, file=sys.stderr, flush=True)


def report_outcome(message: str, code: int) -> int:
    """Print a command's outcome in one line and return ``code``. Every rank reaches the same
    outcome; success is printed by rank 0. A failure must reach the terminal whichever rank gets
    there first: torchrun stops every rank as soon as one exits non-zero, so a rank that prints
    must not be stopped by a peer that exited before it (rank 0 can start seconds after the others
    on a loaded machine). Under torchrun the first rank to report a failure prints it and the
    others wait until it has (``_say_once``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if code == 0 or world == 1:
        if os.environ.get("RANK", "0") == "0":
            say_outcome(message)
    else:
        _say_once(message)
    return code


def _agent_store() -> dist.TCPStore | None:
    """torchrun's key-value store, which its agent hosts for the whole launch and which every rank
    can reach before any process group exists (None without one: another launcher, or torchrun
    with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=OUTCOME_WAIT,
        )
    except (KeyError, ValueError, RuntimeError):  # DistError is a RuntimeError
        return None


def _say_once(message: str) -> None:
    """``message`` on stderr once per launch: the first rank that reaches it prints it, then marks
    it printed in torchrun's store; a rank that comes later waits for that mark before it returns
    (and exits). No rank waits on a peer that has not failed, so a failure seen by one rank only
    is printed too. Without torchrun's store every rank prints it."""
    store = _agent_store()
    if store is not None:
        digest = hashlib.sha256(message.encode()).hexdigest()[:16]
        key = (
            f"upipe_dtensor/outcome/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{digest}"
        )
        try:
            if store.add(key, 1) > 1:
                store.wait([f"{key}/printed"])
                return
            say_outcome(message)
            store.set(f"{key}/printed", "1")
            return
        except RuntimeError:  # the printing rank died first, or the store is gone: say it here
            pass
    say_outcome(message)


def run_main(work: Callable[[], object], *, report_on_stdout: bool = False) -> int:
    """Run a command's ``work`` and return its exit code: 0 when it returns, else the code of the
    outcome it raised, printed in one line (``report_outcome``). Every command starts here, so
    its log output is set up here, once (``runtime.logs``; ``report_on_stdout``: the command's
    stdout is its report alone, its log lines go to stderr). The process group, if the work made
    one, is destroyed either way."""
    try:
        set_up_logging(report_on_stdout=report_on_stdout)
        work()
    except ConfigError as err:
        return report_outcome(f"config error: {err}", 2)
    except DoesNotFit as answer:
        return report_outcome(str(answer), DOES_NOT_FIT)
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


def command_main(command: Callable[[list[str]], int], argv: list[str] | None) -> int:
    """A ``python -m`` module's ``main``: ``command`` on ``argv``, returning its exit code. Without
    ``argv`` it is the process's command (``python -m``, the console script): it reads
    ``sys.argv`` and ends the process with the code through ``end_process``, as every entry point
    that may run ranks does."""
    if argv is not None:
        return command(argv)
    end_process(command(sys.argv[1:]))


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
