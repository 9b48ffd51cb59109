"""What a rank does with each stop signal, decided in one process (the launcher's part is in
test_interrupts.py): a second Ctrl-C, as a SIGINT or as torchrun's SIGTERM, stops at once; a
signal whose step would outlast the grace period stops at once, naming the snapshot that stands
and the steps lost; torchrun's SIGTERM after a rank died names that rank."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from upipe_dtensor.runtime import rank_deaths, shutdown
from upipe_dtensor.runtime.rank_deaths import RankProcess, gone_ranks, is_communication_failure
from upipe_dtensor.runtime.shutdown import StopRequests, steps_lost

pytestmark = pytest.mark.unit

HINT = "the last good snapshot is out/checkpoint/step-10"


class Exited(Exception):
    """What ``_exit_now`` would have ended the process with."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message, self.code = message, code


@pytest.fixture
def stop(monkeypatch):
    """A StopRequests of rank 0 whose exits are recorded, not taken, at step 14 of a job whose
    snapshot step-10 stands."""

    def exit_now(message: str, code: int, *, speak: bool = True) -> None:
        raise Exited(message, code)

    monkeypatch.setattr(shutdown, "_exit_now", exit_now)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(rank_deaths.dist, "get_rank", lambda group=None: 0)
    requests = StopRequests(20.0, lambda: (HINT, 10))
    requests.step_begins(14)
    yield requests
    requests.close()


def test_a_second_ctrl_c_stops_at_once_also_when_torchrun_sends_it_as_sigterm(stop) -> None:
    stop._handle(signal.SIGINT)  # first press: finish the step (its length is not known yet)
    stop._handle(signal.SIGINT)  # the same press, forwarded once more by a launcher
    with pytest.raises(Exited) as torchrun_second:
        stop._handle(signal.SIGTERM)  # torchrun passes a second press on as SIGTERM
    assert torchrun_second.value.code == 130
    assert torchrun_second.value.message == (
        "rank 0: Ctrl-C again (torchrun passes a second Ctrl-C on as SIGTERM): stopped at once, "
        f"without a new snapshot ({HINT}; steps 11-14 will be trained again); run the same "
        "command to resume"
    )
    stop._first_at -= shutdown.SAME_PRESS_SECONDS  # a later SIGINT is a second press too
    with pytest.raises(Exited, match=r"^rank 0: Ctrl-C again: stopped at once") as second:
        stop._handle(signal.SIGINT)
    assert second.value.code == 130


def test_repeated_sigterms_are_one_request(stop) -> None:
    """Slurm signals every process of a step and torchrun forwards the same signal once more."""
    stop._handle(signal.SIGTERM)
    stop._handle(signal.SIGTERM)
    stop._handle(signal.SIGINT)
    assert stop.signum == signal.SIGTERM


def test_a_step_longer_than_the_grace_stops_at_once_naming_the_snapshot(stop) -> None:
    stop.last_step_seconds = 236.0  # a 1M-token step of Llama3-8B, predicted
    with pytest.raises(Exited) as stopped:
        stop._handle(signal.SIGTERM)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert stopped.value.message.startswith("rank 0: SIGTERM received 0 s into step 14; a step ")
    assert stopped.value.message.endswith(
        "takes about 236 s here (the last one), so the next step boundary is 236 s away, more "
        "than [job] stop_grace_seconds = 20 s: stopped at once, without a new snapshot (the last "
        "good snapshot is out/checkpoint/step-10; steps 11-14 will be trained again); run the "
        "same command to resume"
    )


def test_a_step_that_ends_within_the_grace_is_waited_for(stop) -> None:
    stop.last_step_seconds = 5.0
    stop._handle(signal.SIGUSR1)  # no exit: the boundary comes within the grace period
    assert stop.signum == signal.SIGUSR1 and stop._deadline.interval == 20.0


def test_steps_lost() -> None:
    assert steps_lost(10, 10) == "no finished step is lost"
    assert steps_lost(10, 11) == "step 11 will be trained again"
    assert steps_lost(0, 3) == "steps 1-3 will be trained again"


def test_sigterm_after_a_rank_died_names_it(stop) -> None:
    """torchrun sends SIGTERM to the other ranks when one dies; a zombie's exit code says how."""
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead.kill()
    while _state(dead.pid) != "Z":  # killed, not yet collected: what torchrun has not reaped
        time.sleep(0.01)
    host = socket.gethostname()
    stop.peers = [RankProcess(0, host, 1), RankProcess(1, host, dead.pid)]
    assert gone_ranks(stop.peers) == [(stop.peers[1], "killed by SIGKILL")]
    with pytest.raises(Exited) as died:
        stop._handle(signal.SIGTERM)
    dead.wait()
    assert died.value.code == 1
    assert died.value.message.startswith(
        f"rank 0: rank 1 (pid {dead.pid}, killed by SIGKILL) died during step 14. Likely cause: "
        "the kernel's OOM killer"
    )
    assert died.value.message.endswith(
        "The last good snapshot is out/checkpoint/step-10; steps 11-14 will be trained again; run "
        "the same command to resume"
    )
    stop.peers = [RankProcess(0, host, 1), RankProcess(1, host, dead.pid)]  # reaped: gone
    assert gone_ranks(stop.peers) == [(stop.peers[1], "")]


def test_a_gloo_error_from_a_dead_peer_is_recognised() -> None:
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:47506: Connection reset by peer. This is typically caused by a remote worker"
    )
    assert is_communication_failure(gloo)
    assert not is_communication_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]
