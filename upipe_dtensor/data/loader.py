"""Text data for training: the tokenizer, and documents packed into (inputs, labels) batches.

Documents come from local ``.txt`` / ``.jsonl`` / ``.parquet`` files or a streamed Hugging Face
dataset. Each becomes ``[BOS] + tokens + [EOS]``; a data-parallel rank concatenates its documents
into one token stream and cuts it into consecutive, non-overlapping windows of ``seq_len + 1``.

- Sharding is by document: the i-th document goes to dp rank ``i % dp_world_size``. The order is
  fixed (sorted paths, or the stream's order) and nothing is shuffled, so every context-parallel
  rank of one dp rank builds the same batches on its own. Several local sources
  (``[[training.sources]]``) are mixed by ``data.mixture``: each keeps its share of the tokens,
  its long documents upsampled.
- A ``.txt`` file holds one document, or several separated by form feeds (``"\\f"``); each is
  stripped of surrounding whitespace, and blank ones are dropped. ``.jsonl`` and ``.parquet`` hold
  one document per record, in ``text_field``.
- A record that cannot be a document (a line that is not JSON, no ``text_field``, a text that is
  not a string or is blank, a file that is not UTF-8 or not parquet) stops the loader with its file
  and line, or is skipped with ``skip_bad=True``; ``data.checks`` finds them all before a job
  starts. Documents are numbered after blanks and skipped records are left out.
- The loader's state is a position in the stream (epoch, document, tokens of it already used; per
  source for a mixture), so resuming tokenizes one document per source, and changing ``seq_len``
  or ``batch_size`` on resume is fine. It also holds how many documents of the epoch were read
  and a SHA-256 of them, so a resume can tell whether the data it continues on is the data it
  stopped on.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pyarrow.parquet as pq
import torch
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from upipe_dtensor.config.schema import ConfigError, DataSource, JobConfig, source_label
from upipe_dtensor.data.mixture import (
    Mixture,
    MixtureDocuments,
    SourceStream,
    hash_document,
    mixture_description,
)
from upipe_dtensor.data.token_files import (
    TokenFolder,
    TokenStream,
    is_token_folder,
    without_manifest,
)

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet")
RECORD_FIX = (
    "fix or remove it, set text_field ([training] dataset_text_field) to the field that holds "
    "the document text, or skip bad records ([training] skip_bad_records = true)"
)
HUB_PROBE_SECONDS = 5.0
"""How long the reachability probe of the Hugging Face Hub waits before calling it unreachable."""


class Tokenizer(HuggingFaceTokenizer):
    """torchtitan's Hugging Face tokenizer, with an ``encode`` that adds no special tokens.

    The packer places BOS/EOS itself: tokenizers whose post-processor prepends BOS (Llama 3's)
    would otherwise start documents with two, and ``<|end_of_text|>`` written inside a document
    stays text instead of becoming a real EOS.
    """

    def __init__(self, tokenizer_dir: str) -> None:
        super().__init__(tokenizer_path=tokenizer_dir)  # 0.3.0's constructor is keyword-only
        self.tokenizer.encode_special_tokens = True

    def encode(  # type: ignore[override]
        self, text: str, *, add_bos: bool = False, add_eos: bool = False
    ) -> list[int]:
        """Token ids of ``text``; BOS/EOS only when asked for, as torchtitan's datasets ask."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos


def build_tokenizer(tokenizer_path: str) -> Tokenizer:
    """Load ``tokenizer.json`` + ``tokenizer_config.json`` (BOS/EOS names) from a directory.

    ``tokenizer_path`` may also be the ``tokenizer.json`` file itself.
    """
    path = Path(tokenizer_path)
    fix = (
        "pass the directory holding tokenizer.json and tokenizer_config.json "
        "(the shipped one is assets/tokenizer; scripts/make_assets.py regenerates it)"
    )
    if not path.exists():
        raise ValueError(f"tokenizer path {str(path)!r} does not exist; {fix}")
    directory = path.parent if path.is_file() and path.name == "tokenizer.json" else path
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer.json at {str(path)!r}; {fix}")
    try:
        tokenizer = Tokenizer(str(directory))
    except Exception as e:  # `tokenizers` raises a bare Exception for a malformed tokenizer.json
        raise ValueError(f"cannot load the tokenizer in {str(directory)!r}: {e}; {fix}") from e
    if tokenizer.bos_id is None or tokenizer.eos_id is None:
        raise ValueError(
            f"tokenizer in {str(directory)!r} has no BOS/EOS token (bos_id={tokenizer.bos_id}, "
            f"eos_id={tokenizer.eos_id}); name them as bos_token and eos_token in "
            f"{str(directory / 'tokenizer_config.json')!r}, "
            'e.g. "<|begin_of_text|>" and "<|end_of_text|>"'
        )
    return tokenizer


def job_tokenizer(config: JobConfig) -> Tokenizer:
    """The job's tokenizer, before any process group: a ``ConfigError`` naming where
    ``[model] tokenizer_path`` was set (the commands and ``set_up_job`` word it once, here)."""
    try:
        return build_tokenizer(config.model.tokenizer_folder)
    except ValueError as err:
        where = config.source_of("model.tokenizer_path", "model.hf_assets_path")
        raise ConfigError(f"{where}: [model] tokenizer_path: {err}") from err


@dataclass(frozen=True)
class Record:
    """One record of a data file: its document text, or why it cannot be a document."""

    where: str
    """The file and line (``.txt``, ``.jsonl``), the file and row (``.parquet``), or the file."""
    text: str = ""
    problem: str = ""

    @property
    def message(self) -> str:
        return f"{self.where}: {self.problem}"


def _text_record(value: Any, where: str) -> Record:
    if not isinstance(value, str):
        return Record(where, problem=f"the document text is {type(value).__name__}, not a string")
    if not value.strip():
        return Record(where, problem="the document text is blank")
    return Record(where, text=value)


def _field_record(record: Any, field: str, where: str) -> Record:
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        return Record(where, problem=f"record has no field {field!r} (it has {keys})")
    return _text_record(record[field], where)


def _unreadable(path: Path, err: OSError) -> Record:
    return Record(str(path), problem=f"cannot be read ({err.strerror or err})")


def _txt_records(path: Path, field: str) -> Iterator[Record]:
    try:
        raw = path.read_bytes()
    except OSError as err:
        yield _unreadable(path, err)
        return
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        yield Record(f"{path}:{line}", problem=f"not UTF-8 text (byte {err.start:,})")
        return
    line = 1
    for part in text.replace("\r\n", "\n").replace("\r", "\n").split("\f"):
        if part.strip():  # blanks between form feeds are not records
            start = line + part[: len(part) - len(part.lstrip())].count("\n")
            yield Record(f"{path}:{start}", text=part.strip())
        line += part.count("\n")


def _jsonl_line(raw: bytes, field: str, where: str) -> Record:
    try:
        return _field_record(json.loads(raw.decode("utf-8")), field, where)
    except UnicodeDecodeError as err:
        return Record(where, problem=f"not UTF-8 text (byte {err.start:,} of the line)")
    except json.JSONDecodeError as err:
        return Record(where, problem=f"not valid JSON, one object per line ({err})")


def _jsonl_records(path: Path, field: str) -> Iterator[Record]:
    try:
        handle = path.open("rb")
    except OSError as err:
        yield _unreadable(path, err)
        return
    with handle:
        for lineno, raw in enumerate(handle, 1):
            if raw.strip():  # blank lines are not records
                yield _jsonl_line(raw, field, f"{path}:{lineno}")


def _open_parquet(path: Path, field: str) -> pq.ParquetFile | Record:
    """The file (only its footer is read), or the problem that makes all of it unusable."""
    try:
        file = pq.ParquetFile(path)
    except OSError as err:
        return _unreadable(path, err)
    except Exception as err:  # pyarrow's ArrowInvalid: not a parquet file
        return Record(str(path), problem=f"is not a readable parquet file ({err})")
    names = file.schema_arrow.names
    if field not in names:
        return Record(str(path), problem=f"has no column {field!r} (it has {names})")
    return file


def _parquet_records(path: Path, field: str) -> Iterator[Record]:
    file = _open_parquet(path, field)
    if isinstance(file, Record):
        yield file
        return
    row = 0
    for batch in file.iter_batches(columns=[field]):
        for value in batch.column(0).to_pylist():
            yield _text_record(value, f"{path} row {row}")
            row += 1


_RECORDS: dict[str, Callable[[Path, str], Iterator[Record]]] = {
    ".txt": _txt_records,
    ".jsonl": _jsonl_records,
    ".parquet": _parquet_records,
}


def read_records(path: Path, field: str) -> Iterator[Record]:
    """Every record of one data file, good and bad, in order (the reader its suffix names)."""
    return _RECORDS[path.suffix](path, field)


def good_texts(records: Iterable[Record], skip_bad: bool) -> Iterator[str]:
    """The texts of ``records``; a bad one is skipped (``skip_bad``) or a ValueError."""
    for record in records:
        if not record.problem:
            yield record.text
        elif not skip_bad:
            raise ValueError(f"{record.message}; {RECORD_FIX}")


def list_files(dataset_path: str, key: str = "dataset_path") -> list[Path]:
    """The data files of ``dataset_path``: the file itself, or a folder's supported files in
    sorted relative-path order. ValueError naming the problem (the path as ``key``) and a fix."""
    kinds = "/".join(SUPPORTED_SUFFIXES)
    fix = f"point {key} at a {kinds} file or a directory of them (e.g. assets/corpus)"
    root = Path(dataset_path)
    if not dataset_path or not root.exists():
        raise ValueError(f"{key} {dataset_path!r} does not exist; {fix}")
    if root.is_file():
        if root.suffix not in SUPPORTED_SUFFIXES:
            raise ValueError(f"{key} {dataset_path!r} is not a supported file; {fix}")
        return [root]
    files = sorted(
        (p for p in root.rglob("*") if p.is_file() and p.suffix in SUPPORTED_SUFFIXES),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise ValueError(
            without_manifest(root, key) or f"{key} {dataset_path!r} holds no {kinds} files; {fix}"
        )
    return files


class LocalDocuments:
    """The documents of one file, or of a directory's files in sorted relative-path order."""

    def __init__(
        self,
        dataset_path: str,
        text_field: str,
        *,
        skip_bad: bool = False,
        key: str = "dataset_path",
    ) -> None:
        """``key``: what messages call the path (a [[training.sources]] table's path)."""
        self.description = f"{key} {dataset_path!r}"
        self.files = list_files(dataset_path, key)
        self.text_field = text_field
        self.skip_bad = skip_bad
        for file in self.files:  # a wrong text_field fails now, not after hours of other files
            if file.suffix in (".jsonl", ".parquet") and not skip_bad:
                first = next(read_records(file, text_field), None)
                if first is not None and first.problem:
                    raise ValueError(f"{first.message}; {RECORD_FIX}")

    def records(self) -> Iterator[Record]:
        """Every record of every file, good and bad, in order."""
        for file in self.files:
            yield from read_records(file, self.text_field)

    def __iter__(self) -> Iterator[str]:
        return good_texts(self.records(), self.skip_bad)


def hub_unreachable(name: str) -> str:
    """Why the Hugging Face Hub cannot serve dataset ``name`` ("" if it may): a few seconds'
    connection probe instead of ``datasets``' retries, which take half a minute to fail offline.
    Skipped (""), leaving the answer to ``datasets``, in offline mode (it fails at once) and
    behind a proxy (a direct probe would not tell)."""
    offline = os.environ.get("HF_DATASETS_OFFLINE") or os.environ.get("HF_HUB_OFFLINE")
    proxies = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
    if (offline and offline != "0") or any(os.environ.get(p) for p in proxies):
        return ""
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=HUB_PROBE_SECONDS).close()
    except OSError as err:
        return hub_error(name, f"cannot reach {endpoint.hostname}:{port} ({err})")
    return ""


def hub_error(name: str, why: str) -> str:
    """The one-line failure for a Hugging Face dataset that cannot be streamed, with the fixes."""
    return (
        f"Hugging Face dataset {name!r} cannot be streamed: {why}. Without network access, set "
        "HF_DATASETS_OFFLINE=1 to read a cached copy, or save the dataset as .jsonl/.parquet "
        "files and set [training] dataset = 'local' and dataset_path to them"
    )


class HubDocuments:
    """A Hugging Face dataset, streamed in its own order (needs network access, or a cached copy
    with ``HF_DATASETS_OFFLINE=1``): its subset ``config_name`` (what ``load_dataset`` calls
    ``name``; "" for the dataset's default) and its ``split``."""

    def __init__(
        self,
        name: str,
        split: str,
        text_field: str,
        *,
        config_name: str = "",
        skip_bad: bool = False,
    ) -> None:
        if why := hub_unreachable(name):
            raise ValueError(why)
        from datasets import load_dataset  # slow to import, and only hub datasets need it

        subset = f" subset {config_name!r}" if config_name else ""
        self.description = f"Hugging Face dataset {name!r}{subset} split {split!r}"
        try:
            self.dataset = load_dataset(name, config_name or None, split=split, streaming=True)
        except Exception as err:  # datasets raises several kinds; each one becomes this line
            raise ValueError(hub_error(name, f"{type(err).__name__}: {err}")) from err
        self.text_field = text_field
        self.skip_bad = skip_bad

    def records(self) -> Iterator[Record]:
        """Every example as a record, good and bad, in the stream's order."""
        for i, example in enumerate(self.dataset):
            yield _field_record(example, self.text_field, f"{self.description} example {i}")

    def __iter__(self) -> Iterator[str]:
        return good_texts(self.records(), self.skip_bad)


Documents = LocalDocuments | HubDocuments | TokenFolder
"""One source's documents: text files, a streamed Hugging Face dataset, or a token folder."""


def _source_stream(documents: Documents, source: DataSource, **kwargs: Any) -> SourceStream:
    """The stream of one source: a token folder's (checked against the job's tokenizer, read by
    index) or text tokenized as it is read."""
    if isinstance(documents, TokenFolder):
        tokenizer = kwargs.pop("tokenizer")
        documents.check_tokenizer(tokenizer)
        return TokenStream(documents, source, **kwargs)
    return SourceStream(documents, source, **kwargs)


def documents_digest(documents: Iterable[str], count: int) -> tuple[int, str]:
    """How many of the first ``count`` documents exist, and the SHA-256 the loader's state holds
    after reading them (``PackedTextLoader.read_state``)."""
    hasher, read = hashlib.sha256(), 0
    for text in documents:
        if read == count:
            break
        hash_document(hasher, text)
        read += 1
    return read, hasher.hexdigest()


class PackedTextLoader:
    """Documents -> [BOS] + tokens + [EOS], concatenated, cut into windows of seq_len + 1 tokens;
    yields (inputs, labels) LongTensors of shape (batch_size, seq_len): inputs = w[:-1],
    labels = w[1:].

    Infinite: each source repeats in the same order, epoch after epoch. Without ``sources``, one
    source: ``dataset_path`` for ``dataset="local"``, else the Hugging Face dataset ``dataset``
    (its subset ``dataset_config_name`` and ``split``). With ``sources`` (local only), their
    mixture (``data.mixture``): each source's share of the tokens, its long documents upsampled,
    copies placed by ``seed``. A local path that is a token folder (``data.token_files``) is read
    by memory map instead of tokenized: the same documents give the same batches.
    """

    def __init__(
        self,
        *,
        dataset: str,
        dataset_path: str,
        text_field: str,
        tokenizer: Tokenizer,
        seq_len: int,
        batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        split: str = "train",
        dataset_config_name: str = "",
        skip_bad_records: bool = False,
        sources: Sequence[DataSource] = (),
        seed: int = 0,
    ) -> None:
        sizes = {"seq_len": seq_len, "batch_size": batch_size, "dp_world_size": dp_world_size}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank must be in [0, {dp_world_size}), got {dp_rank}")
        if not dataset:
            raise ValueError(
                "dataset must be 'local' (files at dataset_path) or a Hugging Face dataset name"
            )
        if sources and dataset != "local":
            raise ValueError(f"[[training.sources]] are local files, but dataset is {dataset!r}")
        self.seq_len, self.batch_size = seq_len, batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.tokenizer = tokenizer
        if sources:
            paths = [(source, f"{source_label(n)} path") for n, source in enumerate(sources, 1)]
        elif dataset == "local":
            paths = [(DataSource(path=dataset_path), "dataset_path")]
        else:
            paths = []
        parts: list[Documents] = [
            TokenFolder.open(source.path, key)
            if is_token_folder(source.path)
            else LocalDocuments(source.path, text_field, skip_bad=skip_bad_records, key=key)
            for source, key in paths
        ] or [
            HubDocuments(
                dataset,
                split,
                text_field,
                config_name=dataset_config_name,
                skip_bad=skip_bad_records,
            )
        ]
        streams = [
            _source_stream(
                documents,
                source,
                tokenizer=tokenizer,
                dp_rank=dp_rank,
                dp_world_size=dp_world_size,
                seed=seed,
                number=number,
            )
            for number, (documents, source) in enumerate(zip(parts, sources or [DataSource()]), 1)
        ]
        self.stream: SourceStream | Mixture = streams[0] if len(streams) == 1 else Mixture(streams)
        self.documents: Documents | MixtureDocuments = (
            parts[0]
            if len(parts) == 1
            else MixtureDocuments(parts, mixture_description([s.path for s in sources]))
        )
        # The item the next token comes from (a position of the stream), and its tokens used.
        self._position, self._offset = self.stream.start(), 0

    def check_first_document(self) -> None:
        """Read (and tokenize) this rank's first document of every source now, so an empty
        corpus or a bad first record fails before a training job builds its model, not at its
        first batch."""
        next(self.stream.items(self._position))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches from the current position; follows a ``load_state_dict`` made between batches.

        Resuming tokenizes only the document the position is in (one per source of a mixture)."""
        need = self.batch_size * (self.seq_len + 1)
        here = None
        while True:
            if here != (self._position, self._offset):
                items = self.stream.items(self._position)
                position, tokens = next(items)
                # min: on changed data (accept_data_change) the document may now be shorter
                offset = min(self._offset, len(tokens)) if position == self._position else 0
            pieces, have = [], 0
            while have < need:
                if offset == len(tokens):
                    position, tokens = next(items)
                    offset = 0
                taken = tokens[offset : offset + need - have]
                pieces.append(np.asarray(taken, dtype=np.int64))
                have += len(taken)
                offset += len(taken)
            self._position, self._offset = position, offset
            here = position, offset
            rows = torch.from_numpy(np.concatenate(pieces)).view(self.batch_size, self.seq_len + 1)
            yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def read_state(self) -> dict[str, Any]:
        """What this rank has read of the current epoch, per source: the epoch, how many
        documents (every rank reads all of them, up to its own position) and their SHA-256
        (``documents_digest`` recomputes it from the data, to tell whether the data changed)."""
        return self.stream.read_state()

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch starts; the dp geometry is kept to refuse a mismatched resume."""
        return {
            **self._position,
            "offset": self._offset,
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "read": self.read_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        saved = (state.get("dp_rank"), state.get("dp_world_size"))
        if saved != (self.dp_rank, self.dp_world_size):
            raise ValueError(
                f"loader state was saved by dp rank {saved[0]} of {saved[1]} but this loader is "
                f"dp rank {self.dp_rank} of {self.dp_world_size}; documents are assigned by rank, "
                "so resume with the same data-parallel degree"
            )
        self._position, self._offset = self.stream.position_in(state), state["offset"]
