"""Stopping a job on purpose: SIGTERM/SIGUSR1/SIGINT (Ctrl-C) save at the next step boundary
and exit; a second Ctrl-C, or a dead launcher, ends the ranks at once.

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

Ctrl-C in a terminal sends SIGINT to every process of the job, and torchrun forwards it to each
rank once more, so one press reaches a rank two or three times within a moment: a SIGINT within
``SAME_PRESS_SECONDS`` of the first stop signal is the same press. A later SIGINT is a second
press: the rank exits at once, without a snapshot; the last good one is left as it is (a save
in progress is a ``.partial`` folder, never loaded). Signals are seen by a listener thread as they
arrive (``signal.set_wakeup_fd``), not when the main thread next runs Python, which can be
minutes later in a long step: a second press counts from its own arrival, and it stops a rank
that is stuck in a step.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
SAME_PRESS_SECONDS = 1.0
"""SIGINTs arriving within this long of the first stop signal are one Ctrl-C (the terminal's and
torchrun's copies); a later one is a second press."""


def _exit_now(message: str, code: int) -> None:
    """Leave the process from any thread, even while the main thread waits in a collective."""
    try:
        print(message, file=sys.stderr, flush=True)
    finally:
        os._exit(code)


def _ignore(signum: int, frame) -> None:
    """The Python-level handler of a stop signal: the listener thread acts on it instead."""


class StopRequests:
    """Stop signals for the life of the training loop: the first asks for a stop at the next step
    boundary, a second SIGINT exits at once. Python delivers signals to the main thread only; a
    loop run from another thread is not signalled."""

    def __init__(self, grace_seconds: float, resume_hint: str) -> None:
        self.grace_seconds = grace_seconds
        self.resume_hint = resume_hint
        """Names the snapshot an exit without a new one leaves as the resume point (updated after
        saves)."""
        self.signum = 0
        self._first_at = 0.0
        self._deadline: threading.Timer | None = None
        self._previous: dict[int, object] = {}
        self._writer: socket.socket | None = None
        if threading.current_thread() is threading.main_thread():
            self._listen()

    def _listen(self) -> None:
        """Python handlers that do nothing but wake the listener thread through a socket (each
        arriving signal writes its number there), and the thread."""
        reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._previous = {sig: signal.signal(sig, _ignore) for sig in STOP_SIGNALS}
        self._previous_wakeup = signal.set_wakeup_fd(
            self._writer.fileno(), warn_on_full_buffer=False
        )
        threading.Thread(
            target=self._receive, args=(reader,), name="stop-requests", daemon=True
        ).start()

    def _receive(self, reader: socket.socket) -> None:
        with reader:
            while arrived := reader.recv(64):  # b"" once close() closes the other end
                for signum in arrived:
                    if signum in STOP_SIGNALS:
                        self._handle(signum)

    def _handle(self, signum: int) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first_at = signum, now
            self._deadline = threading.Timer(self.grace_seconds, self._expire)
            self._deadline.daemon = True
            self._deadline.start()
            self._announce(signum)
        elif signum == signal.SIGINT and now - self._first_at >= SAME_PRESS_SECONDS:
            _exit_now(
                f"rank {dist.get_rank()}: Ctrl-C again: stopped at once, without a new snapshot "
                f"({self.resume_hint}); run the same command to resume",
                128 + signum,
            )

    def _announce(self, signum: int) -> None:
        if dist.get_rank() == 0:
            again = "; press Ctrl-C again to stop at once" if signum == signal.SIGINT else ""
            print(
                f"{signal.Signals(signum).name} received: finishing this step, then saving a "
                f"snapshot and stopping{again}",
                file=sys.stderr,
                flush=True,
            )

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
        if self._writer is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            self._writer.close()  # ends the listener thread
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
