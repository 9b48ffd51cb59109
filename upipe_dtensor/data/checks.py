"""The training data checked before a job starts, and the fingerprint that tells a resumed job
whether its data changed.

``scan_local_data`` (``scan_sources`` for every source of a mixture) reads every record of every
local file once, streaming, before any process group exists: a bad record deep in a file (a line
that is not JSON, no text field, a text that is not a string or is blank) is found at start-up,
with its file and line, instead of stopping the job hours later with a traceback on every rank,
or never, if it lies past the last step.

A token folder (``data.token_files``) is not read at all: its manifest holds its counts and the
SHA-256 of its files, computed when it was written, and those stand for the files' hashes.

A snapshot records the fingerprint of the data it consumed (``data_fingerprint``): the files
(paths, sizes and the SHA-256 of their bytes) and, per data-parallel rank, how many documents of
the epoch it had read and their SHA-256 (per source of a mixture; for a token folder, its
content hash). ``data_changes`` compares it with the data a resumed job finds. Files are
compared by content, not by modification time: a copy without preserved times, a ``touch`` or a
``git checkout`` changes nothing the job reads.
(Snapshots written before the content hashes record modification times; their files are
compared by size, and the documents already read by content, as always.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from upipe_dtensor.config.schema import source_label
from upipe_dtensor.data.loader import LocalDocuments, Record, documents_digest, read_records
from upipe_dtensor.data.mixture import MixtureDocuments, mixture_description
from upipe_dtensor.data.token_files import TokenFolder, file_sha256, is_token_folder

SHOWN = 3
"""Bad records (and changed files) named in a message; the rest are counted."""
FIX_RECORDS = (
    "fix or remove them, set [training] dataset_text_field to the field that holds the text"
)


SAMPLE_CHARACTERS = 200_000
"""Text kept from the start of each source by the scan: tokenized at start-up, it gives the
source's tokens per character (``data.startup_warnings`` estimates its tokens from it)."""
MANY_LINES = 1000
"""A .txt file read as one document with at least this many lines is named in a warning: it
may hold one document per line, which needs form feeds between documents."""


@dataclass
class SourceScan:
    """One source as the scan found it: its size, for the start-up warnings."""

    description: str
    documents: int = 0
    characters: int = 0
    tokens: int | None = None
    """Exact for a token folder (packed: BOS and EOS included); None for text."""
    sample: list[str] = field(default_factory=list)
    """The first documents' text, ``SAMPLE_CHARACTERS`` in all."""
    sampled: int = 0
    one_document_txt: list[tuple[str, int]] = field(default_factory=list)
    """The .txt files read as one document of ``MANY_LINES`` or more lines, and their lines."""

    def add(self, text: str) -> None:
        """Count one good document (and sample it while the sample has room)."""
        room = SAMPLE_CHARACTERS - self.sampled
        self.documents += 1
        self.characters += len(text)
        if room > 0:
            self.sample.append(text[:room])
            self.sampled += len(self.sample[-1])


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
    sources: list[SourceScan] = field(default_factory=list)
    """Each source's size, in the order of [[training.sources]] (one without tables)."""

    @property
    def emptied_sources(self) -> list[str]:
        """The sources with bad records and no good one: skipping would leave them empty."""
        return [source.description for source in self.sources if source.documents == 0]

    def bad_records_fix(self) -> str:
        """What to do about the bad records: skipping them is offered only where every source
        keeps a document to train on."""
        if self.emptied_sources:
            return (
                f"{FIX_RECORDS} (every record of {', '.join(self.emptied_sources)} is bad, so "
                "[training] skip_bad_records = true would leave nothing of it to train on)"
            )
        return (
            f"{FIX_RECORDS}, or set [training] skip_bad_records = true to train on the other "
            "records"
        )

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
    the path as ``key``). A token folder is not read: its manifest says what it holds, and its
    hashes are the files' fingerprint (``TokenFolder.fingerprint``)."""
    if is_token_folder(dataset_path):
        folder = TokenFolder.open(dataset_path, key)
        source = SourceScan(
            folder.description, documents=folder.documents, tokens=int(folder.manifest["tokens"])
        )
        files = folder.fingerprint()
        return DataScan(folder.description, files, folder.documents, sources=[source])
    documents = LocalDocuments(dataset_path, text_field, skip_bad=True, key=key)
    root = Path(dataset_path)
    source = SourceScan(documents.description)
    scan = DataScan(
        documents.description,
        {_relative(p, root): [p.stat().st_size, file_sha256(p)] for p in documents.files},
        sources=[source],
    )
    for path in documents.files:
        good, lines = 0, 0
        for record in read_records(path, text_field):
            scan.records += 1
            if record.problem:
                scan.bad_count += 1
                if len(scan.bad) < SHOWN:
                    scan.bad.append(record)
                continue
            good += 1
            if good == 1 and path.suffix == ".txt":
                lines = record.text.count("\n") + 1
            source.add(record.text)
        if path.suffix == ".txt" and good == 1 and lines >= MANY_LINES:
            source.one_document_txt.append((_relative(path, root), lines))
    return scan


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
        sources=[source for scan in scans for source in scan.sources],
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


def _token_read_change(saved: dict[str, Any], documents) -> str:
    """``_source_read_change`` where the snapshot or this job reads a token folder: its content
    hash stands for the documents read (nothing is re-read)."""
    now = documents.content_sha256 if isinstance(documents, TokenFolder) else None
    if "content_sha256" not in saved:
        return "the snapshot read text, and this job reads a token folder"
    if now is None:
        return "the snapshot read a token folder, and this job reads text"
    if saved["content_sha256"] != now:
        return "the token folder now holds other tokens than the one read before the snapshot"
    return ""


def _source_read_change(saved: dict[str, Any], documents) -> str:
    if "content_sha256" in saved or isinstance(documents, TokenFolder):
        return _token_read_change(saved, documents)
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
