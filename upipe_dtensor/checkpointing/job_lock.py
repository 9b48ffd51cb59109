"""One job per dump folder: an exclusive ``flock`` on ``<dump_folder>/job.lock`` for the job's life.

Two jobs writing the same snapshots corrupt each other (one deletes the ``.partial`` folder the
other is writing). ``flock`` is released by the kernel when the holding process dies, so a crashed
or killed job never leaves a stale lock behind. The file records who holds it, for the message
the second job prints. (On network filesystems ``flock`` must be enabled: Lustre ``-o flock``;
NFSv4 supports it.)
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from upipe_dtensor.checkpointing.storage import check_writable
from upipe_dtensor.runtime.collectives import on_rank0
from upipe_dtensor.runtime.errors import JobError

LOCK_FILE = "job.lock"


class JobLock:
    """Held by rank 0 of a job from start-up to exit."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise ``JobError`` naming the holder (host, pid, start time)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace")
            os.close(fd)
            raise JobError(
                f"{self.path.parent} is in use by another job ({_describe(holder)}); wait for it "
                f"to finish or stop it, or set another [job] dump_folder"
            ) from None
        os.ftruncate(fd, 0)
        os.write(
            fd,
            json.dumps(
                {
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                }
            ).encode(),
        )
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def claim_dump_folder(dump: Path, checkpoint_folder: Path | None) -> JobLock:
    """Rank 0 checks that the folders a job writes are writable (``checkpoint_folder``: None
    when it saves no snapshots) and locks the dump folder; every rank raises the same
    ``JobError`` if not (collective). Returns the lock: held on rank 0, never taken elsewhere
    (releasing it there does nothing)."""
    lock = JobLock(dump)

    def claim() -> None:
        fix = "fix its permissions or set [job] dump_folder (and [checkpoint] folder) elsewhere"
        check_writable(dump, "dump folder", fix)
        if checkpoint_folder is not None:
            check_writable(checkpoint_folder, "checkpoint folder", fix)
        lock.acquire()

    on_rank0(claim)
    return lock


def _describe(holder: str) -> str:
    try:
        info = json.loads(holder)
        return f"host {info['host']}, pid {info['pid']}, since {info['since']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"
