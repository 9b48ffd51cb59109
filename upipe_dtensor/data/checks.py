"""The training data checked before a job starts, and the fingerprint that tells a resumed job
whether its data changed.

``scan_local_data`` (``scan_sources`` for every source of a mixture) reads every record of every
local file once, streaming, before any process group exists: a bad record deep in a file (a line
that is not JSON, no text field, a text that is not a string or is blank) is found at start-up,
with its file and line, instead of stopping the job hours later with a traceback on every rank,
or never, if it lies past the last step.

A snapshot records the fingerprint of the data it consumed (``data_fingerprint``): the files
(paths, sizes and the SHA-256 of their bytes) and, per data-parallel rank, how many documents of
the epoch it had read and their SHA-256 (per source of a mixture). ``data_changes`` compares it
with the data a resumed job finds. Files are compared by content, not by modification time: a
copy without preserved times, a ``touch`` or a ``git checkout`` changes nothing the job reads.
(Snapshots written before the content hashes record modification times; their files are
compared by size, and the documents already read by content, as always.)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from upipe_dtensor.config.schema import source_label
from upipe_dtensor.data.loader import LocalDocuments, Record, documents_digest
from upipe_dtensor.data.mixture import MixtureDocuments, mixture_description

SHOWN = 3
"""Bad records (and changed files) named in a message; the rest are counted."""
BAD_RECORDS_FIX = (
    "fix or remove them, set [training] dataset_text_field to the field that holds the text, or "
    "set [training] skip_bad_records = true to train on the other records"
)


@dataclass
class DataScan:
    """What one pass over the local data found."""

    description: str
    files: dict[str, list]
    """Each file, relative to dataset_path (or as the path of a mixture's source and the file
    relative to it), with its [bytes, SHA-256 of its bytes]."""
    records: int = 0
    bad: list[Record] = field(default_factory=list)
    """The first ``SHOWN`` bad records."""
    bad_count: int = 0

    def bad_summary(self) -> str:
        """The bad records in one line: how many, and the first few with file and line."""
        more = f"; ... ({self.bad_count - SHOWN} more)" if self.bad_count > SHOWN else ""
        return (
            f"{self.bad_count:,} bad record{'s' * (self.bad_count != 1)} of {self.records:,} in "
            f"{self.description}: " + "; ".join(r.message for r in self.bad) + more
        )


def _relative(path: Path, root: Path) -> str:
    return path.name if root.is_file() else path.relative_to(root).as_posix()


def scan_local_data(dataset_path: str, text_field: str, key: str = "dataset_path") -> DataScan:
    """Read every record of ``dataset_path`` once; ValueError if it holds no data files (naming
    the path as ``key``)."""
    documents = LocalDocuments(dataset_path, text_field, skip_bad=True, key=key)
    root = Path(dataset_path)
    scan = DataScan(
        documents.description,
        {_relative(p, root): [p.stat().st_size, file_sha256(p)] for p in documents.files},
    )
    for record in documents.records():
        scan.records += 1
        if record.problem:
            scan.bad_count += 1
            if len(scan.bad) < SHOWN:
                scan.bad.append(record)
    return scan


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 16 MiB pieces (the scan reads every byte anyway;
    hashing adds about a tenth of its time)."""
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        while piece := handle.read(16 * 2**20):
            hasher.update(piece)
    return hasher.hexdigest()


def scan_sources(paths: list[str], text_field: str) -> DataScan:
    """``scan_local_data`` over every [[training.sources]] path (one source: exactly its scan);
    a mixture's files are named ``path: file``, its bad records counted together."""
    if len(paths) == 1:
        return scan_local_data(paths[0], text_field)
    scans = [
        scan_local_data(path, text_field, f"{source_label(number)} path")
        for number, path in enumerate(paths, 1)
    ]
    return DataScan(
        mixture_description(paths),
        {
            f"{path}: {name}": stat
            for path, scan in zip(paths, scans)
            for name, stat in scan.files.items()
        },
        records=sum(scan.records for scan in scans),
        bad=[record for scan in scans for record in scan.bad][:SHOWN],
        bad_count=sum(scan.bad_count for scan in scans),
    )


def data_fingerprint(description: str, files: dict[str, list] | None) -> dict[str, Any]:
    """The part of a snapshot's data record that is the same on every rank (``read`` is added
    per data-parallel rank by the checkpointer). ``files``: None for a streamed dataset."""
    return {"dataset": description, **({"files": files} if files is not None else {})}


def _names(names: list[str]) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _same_file(saved: list, now: list) -> bool:
    """Same size and content; a snapshot from before content hashes recorded [size, mtime]
    (an int), whose files can only be compared by size."""
    if isinstance(saved[1], int):
        return saved[0] == now[0]
    return saved == now


def file_changes(saved: dict[str, list], now: dict[str, list]) -> list[str]:
    """Files added, removed, or of other content, in words."""
    changes = []
    for what, names in (
        ("removed", sorted(set(saved) - set(now))),
        ("added", sorted(set(now) - set(saved))),
        ("changed", sorted(n for n in set(saved) & set(now) if not _same_file(saved[n], now[n]))),
    ):
        if names:
            changes.append(f"{len(names)} file{'s' * (len(names) != 1)} {what} ({_names(names)})")
    return changes


def _source_read_change(saved: dict[str, Any], documents) -> str:
    count = int(saved["documents"])
    found, digest = documents_digest(documents, count)
    if found < count:
        return f"the data now holds {found:,} documents, fewer than the {count:,} already read"
    if digest != saved["sha256"]:
        return f"the {count:,} documents read before the snapshot differ"
    return ""


def read_change(saved: dict[str, Any], documents) -> str:
    """Whether the documents one rank had read before the snapshot are still the same ("" if
    so): re-reads that many documents of the data as it is now, source by source for a mixture,
    and compares their SHA-256."""
    reads = saved.get("sources", [saved])
    parts = documents.parts if isinstance(documents, MixtureDocuments) else [documents]
    if len(reads) != len(parts):
        return f"the snapshot read {len(reads)} source(s), the data now has {len(parts)}"
    if len(parts) == 1:
        return _source_read_change(reads[0], parts[0])
    changes = (
        (part.description, _source_read_change(read, part)) for read, part in zip(reads, parts)
    )
    return "; ".join(f"{where}: {change}" for where, change in changes if change)


def _documents_read(read: dict[str, Any]) -> int:
    """How many documents a rank's read state counts (of every source of a mixture)."""
    return sum(int(source["documents"]) for source in read.get("sources", [read]))


def data_changes(saved: dict[str, Any], current: dict[str, Any], dp_rank: int, documents) -> str:
    """What changed between the data a snapshot recorded and the data now ("" if nothing), as
    this data-parallel rank sees it, and what a resume would then do; ``documents`` iterates the
    data now (``MixtureDocuments`` for a mixture)."""
    changes = []
    if saved.get("dataset") != current["dataset"]:
        changes.append(f"the dataset was {saved.get('dataset')}, now {current['dataset']}")
    if "files" in saved and "files" in current:
        changes += file_changes(saved["files"], current["files"])
    read = saved.get("read", {}).get(str(dp_rank))
    if read is not None:
        documents_change = read_change(read, documents)
        if documents_change:
            changes.append(
                f"{documents_change}, so the saved position now points elsewhere: resuming would "
                "skip or repeat documents"
            )
        elif changes:
            changes.append(
                f"the {_documents_read(read):,} documents read so far are unchanged, so resuming "
                "would go on from the same point, but through the data as it is now"
            )
    return "; ".join(changes)
