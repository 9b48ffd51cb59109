"""Disk checks around snapshots: writable folders at start-up, free space against the snapshot
size, and a plain "no space" message when a save runs out of room.

A save writes a whole new snapshot next to the ones kept (``step-N.partial``, renamed when
complete; the oldest is deleted only afterwards), so a job needs room for ``keep_latest_k + 1``
snapshots. A failed save never touches the snapshots already published.
"""

from __future__ import annotations

import errno
import shutil
import uuid
from pathlib import Path

from torch import nn

from upipe_dtensor.runtime.errors import JobError

MiB, GiB = 2**20, 2**30
ADAMW_STATES = 2
"""AdamW keeps exp_avg and exp_avg_sq, each the size of the (float32 master) parameters."""


def human(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.1f} MiB"


def check_writable(folder: Path, role: str, fix: str) -> None:
    """Create ``folder`` and write a file in it, so a read-only or missing mount fails now and
    not at the first save (by default 500 steps in)."""
    probe = folder / f".write-test-{uuid.uuid4().hex}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except (FileExistsError, NotADirectoryError) as err:  # permissions would not help
        file = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), folder)
        raise JobError(
            f"the {role} {folder} cannot be a folder: {file} is a file; set [job] dump_folder "
            "(and [checkpoint] folder) to a folder path"
        ) from err
    except OSError as err:
        raise JobError(
            f"cannot write to the {role} {folder}: {err.strerror or err}; {fix}"
        ) from err


def snapshot_bytes_estimate(model: nn.Module) -> int:
    """Bytes of a snapshot of ``model`` trained with AdamW: the parameters plus two optimizer
    states of the same size (DTensor ``numel`` is the global count)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params * (1 + ADAMW_STATES)


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def space_report(
    folder: Path, snapshot_bytes: int, keep_latest_k: int, kept: int, saves_left: int
) -> tuple[str, bool]:
    """One line: free space against what the remaining saves need, and whether they all fit (if
    not, the line is a warning). Raises ``JobError`` if not even the next snapshot fits.
    ``kept``: snapshots already in the folder."""
    free = free_bytes(folder)
    at_once = keep_latest_k + 1 if keep_latest_k else kept + saves_left
    needed = snapshot_bytes * max(1, min(saves_left, at_once - kept))
    kept_at_once = (
        f"keep_latest_k + 1 = {keep_latest_k + 1} snapshots at once"
        if keep_latest_k
        else f"keep_latest_k = 0 keeps every snapshot: {at_once} at the end"
    )
    if free < snapshot_bytes:
        raise JobError(
            f"checkpoint folder {folder} has {human(free)} free but one snapshot takes about "
            f"{human(snapshot_bytes)}; free space or point [job] dump_folder elsewhere (this job "
            f"needs room for {kept_at_once})"
        )
    line = (
        f"checkpoint folder {folder}: {human(free)} free, a snapshot takes about "
        f"{human(snapshot_bytes)}, the remaining saves need {human(needed)} more "
        f"({kept_at_once})"
    )
    return (line + "; a later save will run out of space", False) if free < needed else (line, True)


def is_out_of_space(err: BaseException) -> bool:
    """True if ``err`` (or what it wraps, including DCP's per-rank failures) is a full disk. Some
    writers report it only as a short write: "unexpected pos" from torch.save's zip writer."""
    seen: set[int] = set()
    stack: list[BaseException] = [err]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left" in str(current) or "unexpected pos" in str(current):
            return True
        stack += [e for e in (current.__cause__, current.__context__) if e is not None]
        failures = getattr(
            current, "failures", None
        )  # DCP's CheckpointException: rank -> (error, trace)
        if isinstance(failures, dict):
            stack += [pair[0] for pair in failures.values() if isinstance(pair[0], BaseException)]
    return False


def no_space_error(
    step: int, folder: Path, snapshot_bytes: int, last_good: Path | None
) -> JobError:
    free = free_bytes(folder) if folder.exists() else 0
    kept = (
        f"the last good snapshot {last_good} is intact"
        if last_good
        else "no snapshot was saved before"
    )
    return JobError(
        f"saving step-{step} in {folder} failed: no space left on device (the snapshot needs about "
        f"{snapshot_bytes:,} bytes, {free:,} bytes are free after removing the partial save); "
        f"{kept}. Free space, lower [checkpoint] keep_latest_k, or move [job] "
        f"dump_folder: a job needs room for keep_latest_k + 1 snapshots"
    )
