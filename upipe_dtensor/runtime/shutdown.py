"""Stopping a job on purpose: SIGTERM/SIGUSR1 save at the next step boundary and exit; a dead
launcher ends the ranks at once.

Schedulers send SIGTERM before preemption and SIGKILL a fixed time later (torchrun 30 s,
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``; Slurm ``KillWait`` 30 s; Kubernetes
``terminationGracePeriodSeconds`` 30 s); Slurm's ``--signal=USR1@600`` warns ahead of a time limit.
Optimizer state is consistent only between steps, so a snapshot can be taken only at a step
boundary. If the boundary does not come within ``grace_seconds`` of the signal (a long step),
waiting is pointless: the rank exits at once, without a snapshot, and the previous snapshot stays
the resume point. (The grace period starts when Python runs the handler, between two Python
operations of the step; a rank blocked in one long call, such as a GPU synchronisation, sees the
signal when that call returns.) Ranks agree at each boundary (one small all-reduce), so a signal
that reaches
only some ranks still stops all of them at the same step.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _exit_now(message: str, code: int) -> None:
    """Leave the process from any thread, even while the main thread waits in a collective."""
    try:
        print(message, file=sys.stderr, flush=True)
    finally:
        os._exit(code)


class StopRequests:
    """Handlers for SIGTERM and SIGUSR1 for the life of the training loop (Python delivers
    signals to the main thread only; a loop run from another thread is not signalled)."""

    def __init__(self, grace_seconds: float, resume_hint: str) -> None:
        self.grace_seconds = grace_seconds
        self.resume_hint = resume_hint
        """Names the snapshot a deadline exit leaves as the resume point (updated after saves)."""
        self.signum = 0
        self._deadline: threading.Timer | None = None
        in_main = threading.current_thread() is threading.main_thread()
        self._previous = (
            {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS} if in_main else {}
        )

    def _handle(self, signum: int, frame) -> None:
        if self.signum:
            return
        self.signum = signum
        self._deadline = threading.Timer(self.grace_seconds, self._expire)
        self._deadline.daemon = True
        self._deadline.start()

    def _expire(self) -> None:
        name = signal.Signals(self.signum).name
        _exit_now(
            f"rank {dist.get_rank()}: {name} received, but the step did not end within "
            f"[job] stop_grace_seconds = {self.grace_seconds:g} s; exiting without a new snapshot "
            f"({self.resume_hint})",
            128 + self.signum,
        )

    def agreed(self, device: torch.device) -> int:
        """At a step boundary (collective): the signal any rank received, 0 if none."""
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag.item())
        if signum and self._deadline is not None:
            self._deadline.cancel()  # the boundary came in time: save, do not race the timer
        return signum

    def close(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


_watching = False


def watch_launcher(poll_seconds: float = 1.0) -> None:
    """Exit this rank when its parent (torchrun's agent) dies: orphaned ranks would otherwise
    train on and race a restarted job for the same snapshots. Once per process."""
    global _watching
    parent = os.getppid()
    if _watching or parent == 1:
        return  # already watching, or started without a parent to watch
    _watching = True

    def watch() -> None:
        while True:
            time.sleep(poll_seconds)
            if os.getppid() != parent:
                _exit_now(
                    f"rank {os.environ.get('RANK', '?')}: the launcher (pid {parent}) is gone; "
                    "exiting",
                    1,
                )

    threading.Thread(target=watch, name="watch-launcher", daemon=True).start()
