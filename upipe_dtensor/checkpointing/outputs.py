"""Writing into folders a user owns: whatever is already there is never lost.

Every command that writes a result (``convert``, ``evaluate``'s plot and JSON, the planner's sweep,
the Hugging Face export at the end of training) follows one rule:

- an output that already exists is refused before any heavy work, naming what is there, unless
  the command was asked to overwrite it (``--overwrite``);
- even then, only the files the command writes are replaced: nothing else in a folder is removed;
- the output is written to a temporary sibling (``.NAME.partial-TOKEN``) and renamed into place
  when complete, so a killed command leaves no half-written file under the final name. A
  temporary sibling is removed when its command fails; one left by a killed command is inert.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from upipe_dtensor.errors import ConfigError

PREVIEW = 5
"""Entries named when refusing a folder that is not empty."""


def _entries(names: list[str]) -> str:
    """How many entries, naming the first few: "3 entries (a, b, c)"."""
    shown = ", ".join(names[:PREVIEW]) + (", ..." if len(names) > PREVIEW else "")
    return f"{len(names)} entr{'y' if len(names) == 1 else 'ies'} ({shown})"


def describe_contents(folder: Path) -> str:
    """What ``folder`` holds, for a refusal message."""
    return _entries(sorted(p.name for p in folder.iterdir()))


def refuse_nonempty(folder: Path, fix: str) -> None:
    """A ConfigError when ``folder`` is a file or holds anything; ``fix`` says what to do."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{folder} is a file, not a folder; {fix}")
    if folder.is_dir() and any(folder.iterdir()):
        raise ConfigError(f"{folder} is not empty: it holds {describe_contents(folder)}; {fix}")


def refuse_existing(paths: Iterable[Path], fix: str) -> None:
    """A ConfigError naming those of ``paths`` that already exist."""
    there = [str(path) for path in paths if path.exists()]
    if there:
        verb = "exists" if len(there) == 1 else "exist"
        raise ConfigError(f"{', '.join(there)} already {verb}; {fix}")


def temporary_sibling(path: Path, token: str = "") -> Path:
    """A hidden name next to ``path`` to write it under until it is complete (same filesystem, so
    the final rename is atomic). The suffix stays last: writers that choose a format by it (PNG,
    CSV) still do. ``token``: a name every rank agrees on (default: a fresh random one)."""
    token = token or uuid.uuid4().hex[:12]
    return path.with_name(f".{path.stem}.partial-{token}{path.suffix}")


def publish_file(temporary: Path, path: Path, *, overwrite: bool) -> None:
    """Rename a complete ``temporary`` file to ``path``. Without ``overwrite`` an existing ``path``
    is refused at the last moment too: a hard link fails atomically if the name is taken."""
    if overwrite:
        os.replace(temporary, path)
        return
    try:
        os.link(temporary, path)
    except FileExistsError:
        raise ConfigError(
            f"{path} appeared while this command ran; kept it, pass --overwrite to replace it"
        ) from None
    except OSError:  # a filesystem without hard links: check, then rename
        if path.exists():
            raise ConfigError(f"{path} appeared while this command ran; kept it") from None
        os.replace(temporary, path)
        return
    temporary.unlink()


@contextmanager
def writing_file(path: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write; it becomes ``path`` when the block ends
    without an error (``publish_file``) and is removed otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_sibling(path)
    try:
        yield temporary
        publish_file(temporary, path, overwrite=overwrite)
    finally:
        temporary.unlink(missing_ok=True)


def publish_folder(temporary: Path, folder: Path, *, overwrite: bool) -> list[str]:
    """Move a complete ``temporary`` folder into place; returns the names of the entries of
    ``folder`` that were there before and are kept (none written over them).

    A missing or empty ``folder`` is replaced by one rename. A non-empty one only with
    ``overwrite``: each written file replaces its namesake, every other entry stays.
    """
    try:
        os.rename(temporary, folder)  # fails on a non-empty folder and on a file
        return []
    except OSError:
        if not (overwrite and folder.is_dir()):
            shutil.rmtree(temporary, ignore_errors=True)
            refuse_nonempty(folder, "pass --overwrite to replace the files this command writes")
            raise
    written = sorted(item.name for item in temporary.iterdir())
    for name in written:
        os.replace(temporary / name, folder / name)
    temporary.rmdir()
    return sorted(p.name for p in folder.iterdir() if p.name not in written)


def kept_note(kept: list[str], command: str) -> str:
    """A clause naming what a folder output kept beside the new files ("" if nothing)."""
    return f"; kept {_entries(kept)} that {command} did not write" if kept else ""
