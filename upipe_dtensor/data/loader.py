"""Text data for training: the tokenizer, and documents packed into (inputs, labels) batches.

Documents come from local ``.txt`` / ``.jsonl`` / ``.parquet`` files or a streamed Hugging Face
dataset. Each becomes ``[BOS] + tokens + [EOS]``; a data-parallel rank concatenates its documents
into one token stream and cuts it into consecutive, non-overlapping windows of ``seq_len + 1``.

- Sharding is by document: the i-th document goes to dp rank ``i % dp_world_size``. The order is
  fixed (sorted paths, or the stream's order) and nothing is shuffled, so every context-parallel
  rank of one dp rank builds the same batches on its own.
- A ``.txt`` file holds one document, or several separated by form feeds (``"\\f"``); each is
  stripped of surrounding whitespace. ``.jsonl`` and ``.parquet`` hold one document per record,
  in ``text_field``. Blank documents are dropped, in every format, before documents are numbered.
- The loader's state is a position in the stream (epoch, document, tokens of it already used), so
  resuming tokenizes one document, and changing ``seq_len`` or ``batch_size`` on resume is fine.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
from torchtitan.components.tokenizer import HuggingFaceTokenizer

SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet")
_FIELD_FIX = "set text_field to the field that holds the document text"


class Tokenizer(HuggingFaceTokenizer):
    """torchtitan's Hugging Face tokenizer, with an ``encode`` that adds no special tokens.

    The packer places BOS/EOS itself: tokenizers whose post-processor prepends BOS (Llama 3's)
    would otherwise start documents with two, and ``<|end_of_text|>`` written inside a document
    stays text instead of becoming a real EOS.
    """

    def __init__(self, tokenizer_dir: str) -> None:
        super().__init__(tokenizer_dir)
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


def _as_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(
            f"{where}: the document text is {type(value).__name__}, not a string; {_FIELD_FIX}"
        )
    return value


def _field_of(record: Any, field: str, where: str) -> str:
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where}: record has no field {field!r} (it has {keys}); {_FIELD_FIX}")
    return _as_text(record[field], where)


def _read_txt(path: Path, field: str) -> Iterator[str]:
    for part in path.read_text(encoding="utf-8").split("\f"):
        yield part.strip()


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{path}:{lineno} is not valid JSON ({e}); write one object per line"
                    ) from e
                yield _field_of(record, field, f"{path}:{lineno}")


def _open_parquet(path: Path, field: str) -> pq.ParquetFile:
    file = pq.ParquetFile(path)  # reads only the footer
    if field not in file.schema_arrow.names:
        names = file.schema_arrow.names
        raise ValueError(f"{path} has no column {field!r} (it has {names}); {_FIELD_FIX}")
    return file


def _read_parquet(path: Path, field: str) -> Iterator[str]:
    file = _open_parquet(path, field)
    row = 0
    for batch in file.iter_batches(columns=[field]):
        for value in batch.column(0).to_pylist():
            yield _as_text(value, f"{path} row {row}")
            row += 1


_READERS: dict[str, Callable[[Path, str], Iterator[str]]] = {
    ".txt": _read_txt,
    ".jsonl": _read_jsonl,
    ".parquet": _read_parquet,
}


class LocalDocuments:
    """The documents of one file, or of a directory's files in sorted relative-path order."""

    def __init__(self, dataset_path: str, text_field: str) -> None:
        self.description = f"dataset_path {dataset_path!r}"
        self.files = self._list_files(dataset_path)
        self.text_field = text_field
        for file in self.files:  # a wrong text_field fails now, not after hours of other files
            if file.suffix == ".parquet":
                _open_parquet(file, text_field)
            elif file.suffix == ".jsonl":
                next(_read_jsonl(file, text_field), None)

    @staticmethod
    def _list_files(dataset_path: str) -> list[Path]:
        kinds = "/".join(SUPPORTED_SUFFIXES)
        fix = f"point dataset_path at a {kinds} file or a directory of them (e.g. assets/corpus)"
        root = Path(dataset_path)
        if not dataset_path or not root.exists():
            raise ValueError(f"dataset_path {dataset_path!r} does not exist; {fix}")
        if root.is_file():
            if root.suffix not in SUPPORTED_SUFFIXES:
                raise ValueError(f"dataset_path {dataset_path!r} is not a supported file; {fix}")
            return [root]
        files = sorted(
            (p for p in root.rglob("*") if p.is_file() and p.suffix in SUPPORTED_SUFFIXES),
            key=lambda p: p.relative_to(root).as_posix(),
        )
        if not files:
            raise ValueError(f"dataset_path {dataset_path!r} holds no {kinds} files; {fix}")
        return files

    def __iter__(self) -> Iterator[str]:
        for file in self.files:
            for text in _READERS[file.suffix](file, self.text_field):
                if text.strip():
                    yield text


class HubDocuments:
    """A Hugging Face dataset, streamed in its own order (needs network access)."""

    def __init__(self, name: str, split: str, text_field: str) -> None:
        from datasets import load_dataset  # slow to import, and only hub datasets need it

        self.description = f"Hugging Face dataset {name!r} split {split!r}"
        self.dataset = load_dataset(name, split=split, streaming=True)
        self.text_field = text_field

    def __iter__(self) -> Iterator[str]:
        for i, example in enumerate(self.dataset):
            text = _field_of(example, self.text_field, f"{self.description} example {i}")
            if text.strip():
                yield text


class PackedTextLoader:
    """Documents -> [BOS] + tokens + [EOS], concatenated, cut into windows of seq_len + 1 tokens;
    yields (inputs, labels) LongTensors of shape (batch_size, seq_len): inputs = w[:-1],
    labels = w[1:].

    Infinite: the corpus repeats in the same order, epoch after epoch. ``dataset_path`` is read
    only for ``dataset="local"``; any other ``dataset`` is a Hugging Face dataset name.
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
        self.seq_len, self.batch_size = seq_len, batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.tokenizer = tokenizer
        self.documents: LocalDocuments | HubDocuments = (
            LocalDocuments(dataset_path, text_field)
            if dataset == "local"
            else HubDocuments(dataset, split, text_field)
        )
        # Position of the next token: `offset` tokens of global document `document` are used.
        self._epoch, self._document, self._offset = 0, 0, 0

    def check_first_document(self) -> None:
        """Read (and tokenize) this rank's first document now, so an empty corpus or a bad first
        record fails before a training job builds its model, not at its first batch."""
        next(self._rank_documents(0, 0))

    def _rank_documents(self, epoch: int, start: int) -> Iterator[tuple[int, int, list[int]]]:
        """(epoch, global index, packed tokens) of this rank's documents from ``start`` on, forever.

        Skipping to ``start`` re-reads the documents before it but tokenizes none of them.
        """
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id
        while True:
            index = start - 1
            for index, text in enumerate(itertools.islice(self.documents, start, None), start):
                if index % self.dp_world_size == self.dp_rank:
                    yield epoch, index, [bos, *self.tokenizer.encode(text), eos]
            if start == 0 and index < self.dp_rank:
                raise ValueError(
                    f"{self.documents.description} has {index + 1} non-blank documents, so dp rank "
                    f"{self.dp_rank} of {self.dp_world_size} gets none; add documents or lower "
                    "the data-parallel degree"
                )
            epoch, start = epoch + 1, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches from the current position; follows a ``load_state_dict`` made between batches."""
        need = self.batch_size * (self.seq_len + 1)
        position = None
        while True:
            if position != (self._epoch, self._document, self._offset):
                documents = self._rank_documents(self._epoch, self._document)
                epoch, document, tokens = next(documents)
                offset = self._offset if document == self._document else 0
            window: list[int] = []
            while len(window) < need:
                if offset == len(tokens):
                    epoch, document, tokens = next(documents)
                    offset = 0
                taken = tokens[offset : offset + need - len(window)]
                window.extend(taken)
                offset += len(taken)
            self._epoch, self._document, self._offset = epoch, document, offset
            position = epoch, document, offset
            rows = torch.tensor(window, dtype=torch.long).view(self.batch_size, self.seq_len + 1)
            yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def state_dict(self) -> dict[str, int]:
        """Where the next batch starts; the dp geometry is kept to refuse a mismatched resume."""
        return {
            "epoch": self._epoch,
            "document": self._document,
            "offset": self._offset,
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        saved = (state.get("dp_rank"), state.get("dp_world_size"))
        if saved != (self.dp_rank, self.dp_world_size):
            raise ValueError(
                f"loader state was saved by dp rank {saved[0]} of {saved[1]} but this loader is "
                f"dp rank {self.dp_rank} of {self.dp_world_size}; documents are assigned by rank, "
                "so resume with the same data-parallel degree"
            )
        self._epoch, self._document, self._offset = (
            state["epoch"],
            state["document"],
            state["offset"],
        )
