"""Stopping a job on purpose: SIGTERM/SIGUSR1/SIGINT (Ctrl-C) save at the next step boundary
and exit; a second Ctrl-C, a step too long to wait for, a dead rank or a dead launcher end the
ranks at once.

Schedulers send SIGTERM before preemption and SIGKILL a fixed time later (torchrun 30 s,
``--shutdown_timeout`` / ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``; Slurm ``KillWait`` 30 s; Kubernetes
``terminationGracePeriodSeconds`` 30 s); Slurm's ``--signal=USR1@900`` warns ahead of a time limit.
Optimizer state is consistent only between steps, so a snapshot can be taken only at a step
boundary. The rank knows how long its last step took: when the rest of the running step would
take longer than ``grace_seconds`` (a multi-minute step at 1M tokens, hours at 5M), waiting is
pointless, and the rank exits at once without a snapshot, naming the snapshot that stands and the
steps that will be trained again. In the first step of a run there is no such estimate, so the
rank waits ``grace_seconds`` for the boundary and then exits at once all the same. (A rank blocked
in one long call, such as a GPU synchronisation, sees the signal when that call returns.) Ranks
agree at each boundary (one small all-reduce), so a signal that reaches only some ranks still
stops all of them at the same step.

Ctrl-C: a terminal sends SIGINT to its foreground process group. A job started with ``python
train.py`` gets each press itself; under torchrun the ranks run in sessions of their own, so only
torchrun gets the presses: it passes the first on as SIGINT and the second as SIGTERM (its
shutdown, ``elastic.agent.server.api``). So a second stop signal is a second press when it is a
SIGTERM after a pending SIGINT, or a SIGINT more than ``SAME_PRESS_SECONDS`` after the first (a
launcher that leaves the ranks in the terminal's group delivers one press twice within a
moment). A second press exits at once, without a snapshot; the last good one is left as it is (a
save in progress is a ``.partial`` folder, never loaded). Signals are seen by a listener thread
as they arrive (``signal.set_wakeup_fd``), not when the main thread next runs Python, which can
be minutes later in a long step.

The exit code is 128 + the signal's number (130 for Ctrl-C). torchrun itself, stopped by a
signal, exits 1 with its own traceback whatever its ranks returned: the shell sees 130 only from
a job run without torchrun.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from upipe_dtensor.runtime.errors import say_outcome
from upipe_dtensor.runtime.rank_deaths import (
    RankProcess,
    death_message,
    exited_with,
    gone_ranks,
    speaks_for_host,
)

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
SAME_PRESS_SECONDS = 1.0
"""SIGINTs arriving within this long of the first stop signal are one Ctrl-C (a launcher that
leaves the ranks in the terminal's process group forwards each press once more); a later one is a
second press."""


def _exit_now(message: str, code: int, *, speak: bool = True) -> None:
    """Leave the process from any thread, even while the main thread waits in a collective;
    ``speak``: say ``message`` first, as the outcome line (``errors.say_outcome``; one rank per
    node says it)."""
    try:
        if speak:
            say_outcome(message)
    finally:
        os._exit(code)


def _first_local_rank() -> bool:
    """Whether this is the first rank of its node: lines every rank would print alike are
    printed once per node."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _ignore(signum: int, frame) -> None:
    """The Python-level handler of a stop signal: the listener thread acts on it instead."""


def steps_lost(standing_step: int, step: int) -> str:
    """The steps a stop without a snapshot throws away: those after the standing snapshot, up to
    and including ``step`` (the one running, or the last one finished)."""
    if step <= standing_step:
        return "no finished step is lost"
    if step == standing_step + 1:
        return f"step {step} will be trained again"
    return f"steps {standing_step + 1}-{step} will be trained again"


class StopRequests:
    """Stop signals for the life of the training loop: the first asks for a stop at the next step
    boundary (or ends the rank at once when the rest of the step would outlast the grace period),
    a second Ctrl-C exits at once. Python delivers signals to the main thread only; a loop run
    from another thread is not signalled.

    The training loop tells it where it is: ``step_begins(step)`` before each step and
    ``agreed()`` at its boundary; ``standing()`` names the snapshot a stop without a new one
    leaves as the resume point, and its step. It is asked when a signal arrives, not told after
    each save: a signal can land between a save and the loop's next line. ``peers``
    (``rank_deaths.rank_processes()``) lets a SIGTERM that torchrun sends because a rank died say
    so."""

    def __init__(
        self,
        grace_seconds: float,
        standing: Callable[[], tuple[str, int]],
        *,
        peers: list[RankProcess] | None = None,
    ) -> None:
        self.grace_seconds = grace_seconds
        self.standing = standing
        """The snapshot that stands now, in words, and the step it holds (0: a rerun starts from
        the beginning)."""
        self.peers = peers or []
        self.signum = 0
        self.step = standing()[1]
        """The step running, or the last one finished."""
        self.last_step_seconds: float | None = None
        self._step_began: float | None = None
        self._first_at = 0.0
        self._deadline: threading.Timer | None = None
        self._previous: dict[int, object] = {}
        self._writer: socket.socket | None = None
        if threading.current_thread() is threading.main_thread():
            self._listen()

    def _nothing_saved(self) -> str:
        """What a stop without a new snapshot leaves: the standing one, and the steps lost."""
        hint, standing_step = self.standing()
        return f"{hint}; {steps_lost(standing_step, self.step)}"

    def step_begins(self, step: int) -> None:
        self.step, self._step_began = step, time.monotonic()

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
        if signum == signal.SIGTERM and self.peers:
            self._exit_if_a_rank_died()
        if not self.signum:
            self.signum, self._first_at = signum, now
            self._stop_now_if_the_step_is_too_long(now)
            self._deadline = threading.Timer(self.grace_seconds, self._expire)
            self._deadline.daemon = True
            self._deadline.start()
            self._announce(signum)
        elif self.signum == signal.SIGINT and (
            signum == signal.SIGTERM
            or (signum == signal.SIGINT and now - self._first_at >= SAME_PRESS_SECONDS)
        ):
            how = " (torchrun passes a second Ctrl-C on as SIGTERM)" * (signum == signal.SIGTERM)
            _exit_now(
                f"rank {dist.get_rank()}: Ctrl-C again{how}: stopped at once, without a new "
                f"snapshot ({self._nothing_saved()}); run "
                "the same command to resume",
                128 + signal.SIGINT,
                speak=_first_local_rank(),
            )

    def _remaining_seconds(self, now: float) -> float | None:
        """How long until the next step boundary, from the last step's time (None in a run's
        first step). Between steps (a save) a whole step still comes before the boundary."""
        if self.last_step_seconds is None:
            return None
        if self._step_began is None:
            return self.last_step_seconds
        return self.last_step_seconds - (now - self._step_began)

    def _stop_now_if_the_step_is_too_long(self, now: float) -> None:
        remaining = self._remaining_seconds(now)
        if remaining is None or remaining <= self.grace_seconds:
            return
        name = signal.Signals(self.signum).name
        into = (
            f"{now - self._step_began:.0f} s into step {self.step}"
            if self._step_began is not None
            else f"after step {self.step}"
        )
        _exit_now(
            f"rank {dist.get_rank()}: {name} received {into}; a step takes about "
            f"{self.last_step_seconds:.0f} s here (the last one), so the next step boundary is "
            f"{remaining:.0f} s away, more than [job] stop_grace_seconds = {self.grace_seconds:g} "
            f"s: stopped at once, without a new snapshot ({self._nothing_saved()}); run the same "
            "command to resume",
            128 + self.signum,
            speak=_first_local_rank(),
        )

    def _exit_if_a_rank_died(self) -> None:
        """torchrun stops the other ranks with SIGTERM when one dies: say which one died. After a
        Ctrl-C, torchrun's SIGTERM is the second press: a peer that already stopped on it (exit
        code 128 + SIGINT) did not die, and this rank stops the same way."""
        gone = gone_ranks(self.peers)
        if self.signum == signal.SIGINT:
            stopped = exited_with(128 + signal.SIGINT)
            gone = [(process, how) for process, how in gone if how != stopped]
        if gone:
            _exit_now(
                death_message(gone, f"during step {self.step}", self._lost_hint(), None),
                1,
                speak=speaks_for_host(self.peers, [p for p, _ in gone]),
            )

    def _lost_hint(self) -> str:
        lost = self._nothing_saved()
        return f"{lost[:1].upper()}{lost[1:]}"

    def _announce(self, signum: int) -> None:
        if dist.get_rank() == 0:  # every rank gets the signal: said once
            again = "; press Ctrl-C again to stop at once" if signum == signal.SIGINT else ""
            logger.warning(
                "%s received: finishing this step, then saving a snapshot and stopping%s",
                signal.Signals(signum).name,
                again,
            )

    def _expire(self) -> None:
        name = signal.Signals(self.signum).name
        _exit_now(
            f"rank {dist.get_rank()}: {name} received, but the step did not end within "
            f"[job] stop_grace_seconds = {self.grace_seconds:g} s; exiting without a new snapshot "
            f"({self._nothing_saved()})",
            128 + self.signum,
            speak=_first_local_rank(),
        )

    def agreed(self, device: torch.device) -> int:
        """At a step boundary (collective): the signal any rank received, 0 if none. Ends the
        step's clock."""
        if self._step_began is not None:
            self.last_step_seconds = time.monotonic() - self._step_began
            self._step_began = None
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag.item())
        if signum and self._deadline is not None:
            self._deadline.cancel()  # the boundary came in time: save, do not race the timer
        return signum

    def failed_collective(self, error: BaseException) -> None:
        """A collective of the training loop raised ``error``: when a rank died (or a stop at once
        ended the others first), end this rank with the line that says so; otherwise return, and
        the caller re-raises."""
        if self.signum:  # the other ranks stopped at once: this one does too
            _exit_now(
                f"rank {dist.get_rank()}: stopped at once after "
                f"{signal.Signals(self.signum).name}, without a new snapshot ({self._lost_hint()})"
                "; run the same command to resume",
                128 + self.signum,
                speak=False,
            )
        gone = gone_ranks(self.peers)
        speak = speaks_for_host(self.peers, [p for p, _ in gone])
        _exit_now(
            death_message(gone, f"during step {self.step}", self._lost_hint(), error),
            1,
            speak=speak,
        )

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
