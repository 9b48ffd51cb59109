"""Naming a rank that died. A rank killed by SIGKILL (``kill -9``, or the kernel's OOM killer when
host memory runs out) says nothing; its peers find out when a collective fails (gloo: "Connection
reset by peer") or when torchrun, which saw the death, sends them SIGTERM. At start-up every rank
learns each rank's host and process id (``rank_processes``); a survivor then looks for the ranks
of its own host whose process is gone, or is a zombie torchrun has not collected yet
(``gone_ranks``), and says which rank died, the likely cause, the snapshot that stands and that a
rerun resumes from it (``death_message``). A rank on another node cannot be seen from here: the
message then says that another rank stopped answering, and that node's log names it.
"""

from __future__ import annotations

import os
import re
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

COMMUNICATION_FAILURE = re.compile(
    r"connection (reset|closed|refused) by peer|broken pipe|gloo|nccl|socket timeout", re.I
)
"""What a collective raises (a plain RuntimeError) when a peer is gone: gloo's "Read error ...
Connection reset by peer", NCCL's errors."""


@dataclass(frozen=True)
class RankProcess:
    rank: int
    host: str
    pid: int


def rank_processes() -> list[RankProcess]:
    """Every rank's host and process id, by rank (collective; once at start-up)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (socket.gethostname(), os.getpid()))
    return [RankProcess(rank, host, pid) for rank, (host, pid) in enumerate(gathered)]


def _state(pid: int) -> tuple[str, int] | None:
    """(state letter, exit code field) of a process from /proc, None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    exit_code = int(fields[49]) if len(fields) > 49 else 0  # stat field 52: exit_code
    return fields[0], exit_code


def exited_with(code: int) -> str:
    """How ``gone_ranks`` describes a rank that exited with ``code``."""
    return f"exited with code {code}"


def gone_ranks(processes: list[RankProcess]) -> list[tuple[RankProcess, str]]:
    """The ranks of this host whose process has ended, each with how it ended when the kernel
    still tells (a zombie's exit code: "killed by SIGKILL"), else ""."""
    host, gone = socket.gethostname(), []
    for process in processes:
        if process.host != host or process.pid == os.getpid():
            continue
        state = _state(process.pid)
        if state is None:
            gone.append((process, ""))
        elif state[0] in "ZX":
            code = state[1]
            how = (
                f"killed by {signal.Signals(code & 0x7F).name}"
                if code & 0x7F
                else exited_with(code >> 8)
            )
            gone.append((process, how))
    return gone


def is_communication_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because a peer went away."""
    return isinstance(error, dist.DistError) or bool(COMMUNICATION_FAILURE.search(str(error)))


def speaks_for_host(processes: list[RankProcess], gone: list[RankProcess]) -> bool:
    """Whether this rank is the lowest living rank of its host: one line per node, not one per
    rank."""
    host = socket.gethostname()
    dead = {process.rank for process in gone}
    living = [p.rank for p in processes if p.host == host and p.rank not in dead]
    return not living or dist.get_rank() == min(living)


def death_message(
    gone: list[tuple[RankProcess, str]], when: str, hint: str, error: BaseException | None
) -> str:
    """One line: which rank died (or that a rank elsewhere stopped answering), the likely cause,
    the snapshot that stands and what to do."""
    if gone:
        names = ", ".join(
            f"rank {p.rank} (pid {p.pid}{f', {how}' if how else ''})" for p, how in gone
        )
        if all(how.startswith("exited") for _, how in gone):
            cause = "it failed: its own error is printed above"
        else:
            cause = (
                "the kernel's OOM killer (host memory ran out; the kernel log, dmesg, says so) "
                "or a kill -9: a rank that fails by itself prints its own error first, and "
                "torchrun's summary below names the signal"
            )
        what = f"{names} died {when}. Likely cause: {cause}"
    else:
        cause = f" ({str(error).splitlines()[0][:160]})" if error is not None else ""
        what = (
            f"another rank stopped answering {when}{cause}: a rank on another node died (killed "
            "by the OOM killer or kill -9) or its node failed; that node's log and torchrun's "
            "summary name it"
        )
    return f"rank {dist.get_rank()}: {what}. {hint}; run the same command to resume"
