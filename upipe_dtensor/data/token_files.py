"""Token folders: training data tokenized once (``python -m upipe_dtensor.tokenize``), read by
memory map.

A token folder holds three files:

- ``tokens.bin``: every document packed as the loader packs text, ``[BOS] + tokens + [EOS]``,
  back to back, as flat integers of the smallest unsigned type that holds the tokenizer's ids
  (``uint16`` up to 65,536 ids, else ``uint32``), little-endian, no header;
- ``documents.bin``: ``documents + 1`` int64 offsets into ``tokens.bin``, document i being
  ``tokens[offsets[i]:offsets[i + 1]]``;
- ``tokens.json``, the manifest: format, dtype, document and token counts, the SHA-256 of each
  ``.bin`` file computed while writing it (``sha256sum`` gives the same), the tokenizer's identity
  (the SHA-256 of its ``tokenizer.json``, vocabulary size, BOS and EOS ids) and where the text
  came from.

The manifest is written last and the folder is published by one rename (``TokenWriter``), so a
folder with a manifest is complete. Reading one costs O(1): the manifest and two file sizes; the
manifest's hashes are the data fingerprint a snapshot records (``data.checks``), so no record is
read at start-up. Same layout as nanoGPT's ``train.bin`` or Megatron's ``.bin``/``.idx`` pair, kept
to plain numpy so any tool can map it.

``TokenStream`` is the loader's source over a token folder: the same order, dp sharding and
upsampling as ``mixture.SourceStream`` over the same text (so the same batches), but a position is
reached by indexing, so resuming costs nothing however far the job had read.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from upipe_dtensor.checkpointing.outputs import publish_folder, temporary_sibling
from upipe_dtensor.config.schema import DataSource
from upipe_dtensor.data.mixture import Position, SourceStream, copies_of

MANIFEST = "tokens.json"
TOKENS = "tokens.bin"
OFFSETS = "documents.bin"
FORMAT = "upipe-dtensor token folder"
VERSION = 1
OFFSET_DTYPE = np.dtype("<i8")
MANIFEST_KEYS = ("dtype", "documents", "tokens", "tokens_sha256", "documents_sha256", "tokenizer")
"""What a manifest of this version must hold besides its format and version."""
TOKENIZE_AGAIN = "tokenize the text again (python -m upipe_dtensor.tokenize)"


def is_token_folder(path: str | Path) -> bool:
    """Whether ``path`` is a token folder: a folder holding ``tokens.json`` (the one rule that
    tells a token folder from a folder of text files)."""
    return (Path(path) / MANIFEST).is_file()


def without_manifest(path: str | Path, key: str = "dataset_path") -> str:
    """What is wrong with ``path`` if it holds a token folder's ``.bin`` files but no manifest
    (a copy cut short, or the manifest deleted), in one line; "" otherwise. Without its manifest
    a folder is not a token folder (``is_token_folder``), so the text reader would otherwise
    report it as a folder holding no text files."""
    folder = Path(path)
    found = [name for name in (TOKENS, OFFSETS) if (folder / name).is_file()]
    if not found or is_token_folder(folder):
        return ""
    return (
        f"{key} {str(path)!r} holds {' and '.join(found)} but no {MANIFEST}, the manifest that "
        "makes it a token folder (it is written last: the folder was copied in part, or the "
        f"manifest removed); copy the whole folder again, or {TOKENIZE_AGAIN}"
    )


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned little-endian type that holds ids ``0 .. vocab_size - 1``."""
    return np.dtype(np.min_scalar_type(max(vocab_size - 1, 0))).newbyteorder("<")


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 16 MiB pieces."""
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        while piece := handle.read(16 * 2**20):
            hasher.update(piece)
    return hasher.hexdigest()


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What makes two tokenizers give the same ids: the SHA-256 of the ``tokenizer.json`` it was
    loaded from (``data.loader.Tokenizer`` keeps its folder), its vocabulary size and its BOS and
    EOS ids (named in ``tokenizer_config.json``)."""
    folder = Path(tokenizer.tokenizer_path)
    return {
        "path": str(folder),
        "tokenizer_json_sha256": file_sha256(folder / "tokenizer.json"),
        "vocab_size": tokenizer.get_vocab_size(),
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
    }


class TokenWriter:
    """Writes a token folder document by document, hashing as it writes, into a hidden sibling
    of ``folder`` that ``publish`` renames into place once the manifest is written. Memory stays
    bounded by the pieces passed to ``write``; ``close`` without ``publish`` removes the sibling."""

    def __init__(self, folder: Path, dtype: np.dtype) -> None:
        self.folder, self.dtype = folder, dtype
        folder.parent.mkdir(parents=True, exist_ok=True)
        self.temporary = temporary_sibling(folder)
        self.temporary.mkdir()
        self._tokens = (self.temporary / TOKENS).open("wb")
        self._offsets = (self.temporary / OFFSETS).open("wb")
        self._hashes = {TOKENS: hashlib.sha256(), OFFSETS: hashlib.sha256()}
        self.documents, self.tokens = 0, 0
        self._put(OFFSETS, np.zeros(1, OFFSET_DTYPE))

    def _put(self, name: str, array: np.ndarray) -> None:
        data = array.tobytes()
        (self._tokens if name == TOKENS else self._offsets).write(data)
        self._hashes[name].update(data)

    def write(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: ``tokens`` their packed tokens back to back, ``lengths`` each one's
        length."""
        self._put(TOKENS, np.ascontiguousarray(tokens, dtype=self.dtype))
        self._put(OFFSETS, (self.tokens + np.cumsum(lengths, dtype=np.int64)).astype(OFFSET_DTYPE))
        self.documents += len(lengths)
        self.tokens += int(np.sum(lengths, dtype=np.int64))

    def publish(self, record: dict[str, Any], *, overwrite: bool) -> list[str]:
        """Flush and sync the files, write the manifest (``record`` adds the tokenizer and the
        source), and rename the folder into place; returns the entries of an existing folder
        that were kept (``outputs.publish_folder``)."""
        for handle in (self._tokens, self._offsets):
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype.name,
            "documents": self.documents,
            "tokens": self.tokens,
            "tokens_sha256": self._hashes[TOKENS].hexdigest(),
            "documents_sha256": self._hashes[OFFSETS].hexdigest(),
            **record,
        }
        with (self.temporary / MANIFEST).open("w") as handle:
            json.dump(manifest, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        return publish_folder(self.temporary, self.folder, overwrite=overwrite)

    def close(self) -> None:
        """Remove the unpublished folder, if any (after a failure or an interruption)."""
        for handle in (self._tokens, self._offsets):
            handle.close()
        if self.temporary.exists():
            for item in self.temporary.iterdir():
                item.unlink()
            self.temporary.rmdir()


@dataclass
class TokenFolder:
    """An open token folder: its manifest and its two files mapped read-only. ValueError naming
    the problem if the folder is not a complete one of this format."""

    path: str
    description: str
    manifest: dict[str, Any]
    tokens: np.ndarray
    offsets: np.ndarray

    @classmethod
    def open(cls, path: str, key: str = "dataset_path") -> TokenFolder:
        folder = Path(path)
        fix = TOKENIZE_AGAIN
        damaged = f"{key} {path!r}: its manifest {MANIFEST} is damaged"
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except OSError as err:
            raise ValueError(f"{key} {path!r}: cannot read {MANIFEST} ({err}); {fix}") from err
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError: cut short or overwritten
            raise ValueError(
                f"{damaged} (not JSON: {err}); copy the folder again or {fix}"
            ) from err
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ValueError(f"{key} {path!r}: {MANIFEST} is not a token folder manifest; {fix}")
        if manifest.get("version") != VERSION:
            raise ValueError(
                f"{key} {path!r} is token folder version {manifest.get('version')}, this code "
                f"reads version {VERSION}; {fix}"
            )
        missing = [name for name in MANIFEST_KEYS if name not in manifest]
        if missing:
            raise ValueError(
                f"{damaged}: it has no {', '.join(missing)}; copy the folder again or {fix}"
            )
        dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        expected = {
            TOKENS: manifest["tokens"] * dtype.itemsize,
            OFFSETS: (manifest["documents"] + 1) * OFFSET_DTYPE.itemsize,
        }
        for name, size in expected.items():
            found = (folder / name).stat().st_size if (folder / name).is_file() else None
            if found != size:
                what = "is missing" if found is None else f"has {found:,} bytes"
                raise ValueError(
                    f"{key} {path!r}: {name} {what}, its manifest says {size:,}; the folder "
                    f"was damaged or only partly copied: copy it again or {fix}"
                )
        if manifest["documents"] == 0:
            raise ValueError(f"{key} {path!r} holds no documents; tokenize some text into it")
        return cls(
            path=path,
            description=f"{key} {path!r} (token folder)",
            manifest=manifest,
            # Plain ndarray views of the maps: np.memmap's own indexing costs ~10 us a slice.
            tokens=np.memmap(folder / TOKENS, dtype=dtype, mode="r").view(np.ndarray),
            offsets=np.memmap(folder / OFFSETS, dtype=OFFSET_DTYPE, mode="r").view(np.ndarray),
        )

    @property
    def documents(self) -> int:
        return int(self.manifest["documents"])

    @property
    def content_sha256(self) -> str:
        """One hash of both files, as their manifest records them: the folder's identity."""
        both = self.manifest["tokens_sha256"] + self.manifest["documents_sha256"]
        return hashlib.sha256(both.encode()).hexdigest()

    def fingerprint(self) -> dict[str, list]:
        """The files as a snapshot's data record lists text files, [bytes, SHA-256], the hashes
        taken from the manifest (computed when the folder was written; nothing is re-read)."""
        return {
            name: [(Path(self.path) / name).stat().st_size, self.manifest[f"{stem}_sha256"]]
            for name, stem in ((TOKENS, "tokens"), (OFFSETS, "documents"))
        }

    def document(self, index: int) -> np.ndarray:
        """Document ``index``'s packed tokens (a view of the map)."""
        return self.tokens[self.offsets[index] : self.offsets[index + 1]]

    def lengths(self) -> np.ndarray:
        """Every document's packed length (BOS and EOS included), from the offsets alone."""
        return np.diff(self.offsets)

    def check_tokenizer(self, tokenizer: Any) -> None:
        """ValueError unless ``tokenizer`` is the one the folder was written with: ids from
        another tokenizer would train silently on the wrong tokens."""
        saved, now = self.manifest["tokenizer"], tokenizer_identity(tokenizer)
        keys = ("tokenizer_json_sha256", "vocab_size", "bos_id", "eos_id")
        differ = [key for key in keys if saved.get(key) != now[key]]
        if differ:
            shown = ", ".join(f"{key} {saved.get(key)} vs {now[key]}" for key in differ)
            raise ValueError(
                f"{self.description} was tokenized with the tokenizer in {saved.get('path')!r}, "
                f"and this job's [model] tokenizer_path {now['path']!r} differs ({shown}); "
                "set tokenizer_path to the tokenizer it was made with, or tokenize the text "
                "again with this one"
            )


class TokenStream(SourceStream):
    """``SourceStream`` over a token folder: the same items and positions, with no text. An
    upsampled document's waiting copies hold its index instead of its text, and a position is
    reached by index (no document before it is read)."""

    def __init__(
        self,
        folder: TokenFolder,
        source: DataSource,
        *,
        dp_rank: int,
        dp_world_size: int,
        seed: int,
        number: int = 1,
    ) -> None:
        super().__init__(
            folder,
            source,
            tokenizer=None,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            seed=seed,
            number=number,
        )
        self.folder = folder
        if folder.documents <= dp_rank:
            raise ValueError(
                f"{folder.description} has {folder.documents} documents, so dp rank {dp_rank} "
                f"of {dp_world_size} gets none; add documents or lower the data-parallel degree"
            )

    def items(self, position: Position):
        epoch, start, fresh = position["epoch"], position["document"], position.get("fresh", 0)
        copies = [tuple(copy) for copy in position.get("copies", ())]
        world, folder = self.dp_world_size, self.folder
        while True:
            self._epoch = epoch
            first = start + (self.dp_rank - start) % world  # this rank's first index >= start
            for index in range(first, folder.documents, world):
                self._read = index + 1
                while copies and copies[0][0] <= fresh:
                    here = self._position(epoch, index, fresh, copies)
                    yield here, folder.document(copies.pop(0)[1])
                here = self._position(epoch, index, fresh, copies)
                tokens = folder.document(index)
                yield here, tokens
                if copies_of(self.source, len(tokens)) > 1:
                    for due in self._copy_dues(epoch, index, fresh):
                        bisect.insort(copies, (due, index), key=lambda copy: copy[0])
                fresh += 1
            epoch, start = epoch + 1, 0

    def read_state(self) -> dict[str, Any]:
        """As the text stream's, with the folder's content hash standing for the SHA-256 of the
        documents read (``data.checks.read_change`` compares it with the folder's)."""
        return {
            "epoch": self._epoch,
            "documents": self._read,
            "content_sha256": self.folder.content_sha256,
        }
