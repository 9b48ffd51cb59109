"""The order of the documents one data-parallel rank trains on: one source's documents with its
long ones upsampled (``SourceStream``), and several sources interleaved by tokens (``Mixture``).
This is how Fu et al. 2024 ("Data Engineering for Scaling Language Models to 128K Context") mix
data for context extension: every source keeps its share of the tokens, and long documents are
upsampled within their source.

- Document i of a source belongs to dp rank ``i % dp_world_size``, in the source's own order
  (sorted paths, or the stream's). Each rank mixes its own documents, so ranks never share one
  and every context-parallel rank of a dp rank builds the same batches on its own.
- A document of at least ``upsample_min_tokens`` tokens (BOS and EOS included) appears
  ``upsample_factor`` times per pass over its source. The extra copies go to distinct points
  among the next few documents of the source (``COPY_SPREAD``), drawn by a generator seeded with
  [training] seed, the source and the document: no copy directly follows another occurrence of
  its document, and only a few texts wait in memory.
- Sources are interleaved by a rule, not by chance: the next document comes from the source
  furthest behind its share, the fewest tokens drawn per unit of weight (the first on a tie). At
  any point the sources' tokens per unit of weight differ by at most one document, and a resumed
  job whose weights changed moves to the new shares without a burst of one source.
- A stream restarts from a *position*, a small dict that the loader checkpoints: ``items(p)``
  yields ``(position, tokens)`` pairs from the item at ``p`` on. One source's position is
  ``{"epoch", "document"}`` (the loader's format before mixtures; ``"fresh"`` and ``"copies"``
  are added when upsampling), a mixture's is each source's next position and its progress.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from upipe_dtensor.config.schema import DataSource

Position = dict[str, Any]
"""Where a stream's next item starts (see the module docstring); plain data, pickled as is."""

COPY_SPREAD = 8
"""A long document's ``upsample_factor - 1`` extra copies are spread over the next
``COPY_SPREAD * (upsample_factor - 1)`` documents of its source on its rank: far enough apart to
rarely share a packed sequence, near enough that few texts wait in memory and in the state."""


class Encoder(Protocol):
    """What packing needs of a tokenizer (``data.loader.Tokenizer``)."""

    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...


def pack_document(tokenizer: Encoder, text: str) -> list[int]:
    """``[BOS] + tokens + [EOS]``: a document as it is packed. Its length is the one that the
    shares and the upsampling threshold count."""
    return [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id]


def copies_of(source: DataSource, length: int) -> int:
    """How many times a document of ``length`` packed tokens appears per pass over ``source``."""
    return source.upsample_factor if length >= source.upsample_min_tokens else 1


def mixture_description(paths: Sequence[str]) -> str:
    """A mixture as messages and snapshot fingerprints name it: its sources' paths."""
    return "[[training.sources]] " + ", ".join(map(repr, paths))


def hash_document(hasher: Any, text: str) -> None:
    """Add one document to a running hash: its length first, so boundaries count too."""
    data = text.encode("utf-8")
    hasher.update(len(data).to_bytes(8, "little"))
    hasher.update(data)


@dataclass
class MixtureDocuments:
    """The documents of every source of a mixture, for the snapshot's data fingerprint: named by
    their paths, re-read source by source when a resume checks them."""

    parts: list[Iterable[str]]
    description: str


class SourceStream:
    """One source's documents for one dp rank, forever (the source repeats, epoch after epoch),
    each long document ``upsample_factor`` times.

    ``read_state`` is how much of the current epoch has been read (every rank reads every
    document up to its own position) and the SHA-256 of it: a resume compares it with the data
    it finds (``data.checks.read_change``).
    """

    def __init__(
        self,
        documents: Iterable[str],
        source: DataSource,
        *,
        tokenizer: Encoder,
        dp_rank: int,
        dp_world_size: int,
        seed: int,
        number: int = 1,
    ) -> None:
        """``documents`` has a ``description`` for messages; ``number``: the source's place in
        its mixture, which keeps sources' copy placements apart."""
        self.documents, self.source, self.tokenizer = documents, source, tokenizer
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seed, self.number = seed, number
        self._epoch, self._read, self._hasher = 0, 0, hashlib.sha256()

    def start(self) -> Position:
        return self._position(0, 0, 0, [])

    def position_in(self, state: dict[str, Any]) -> Position:
        """The position in a saved loader state; ValueError if a mixture saved it."""
        if "epoch" not in state:
            raise ValueError(
                f"the loader state was saved by a mixture of {len(state.get('sources', []))} "
                f"sources, but this job reads one ({self.documents.description}); resume with "
                "the [[training.sources]] it was saved with, or use another [job] dump_folder"
            )
        keys = ("epoch", "document", "fresh", "copies")
        return {key: state[key] for key in keys if key in state}

    def _position(self, epoch: int, document: int, fresh: int, copies: list) -> Position:
        """``document``: the next document of this rank to draw (its global index); ``fresh``:
        documents drawn so far, the clock that ``copies``, (due, text) pairs, are due by."""
        position: Position = {"epoch": epoch, "document": document}
        if copies or self.source.upsample_factor > 1:
            position.update(fresh=fresh, copies=list(copies))
        return position

    def _copy_dues(self, epoch: int, index: int, fresh: int) -> list[int]:
        """When the extra copies of document ``index``, this rank's ``fresh``-th drawn, come: a
        copy due at n goes right before the n-th fresh document, so at least one other document
        lies between any two occurrences."""
        extra = self.source.upsample_factor - 1
        draw = random.Random(f"{self.seed}/{self.number}/{epoch}/{index}")
        steps = draw.sample(range(2, COPY_SPREAD * extra + 2), extra)
        return sorted(fresh + step for step in steps)

    def items(self, position: Position) -> Iterator[tuple[Position, list[int]]]:
        """(position, packed tokens) of each item from ``position`` on. Skipping to it re-reads
        (and hashes) the documents before it but tokenizes none of them; the copies waiting at
        a position carry their texts."""
        epoch, start, fresh = position["epoch"], position["document"], position.get("fresh", 0)
        copies = [tuple(copy) for copy in position.get("copies", ())]
        while True:
            self._epoch, self._read, self._hasher = epoch, 0, hashlib.sha256()
            index = -1
            for index, text in enumerate(self.documents):
                hash_document(self._hasher, text)
                self._read = index + 1
                if index < start or index % self.dp_world_size != self.dp_rank:
                    continue
                while copies and copies[0][0] <= fresh:
                    here = self._position(epoch, index, fresh, copies)
                    yield here, pack_document(self.tokenizer, copies.pop(0)[1])
                here = self._position(epoch, index, fresh, copies)
                tokens = pack_document(self.tokenizer, text)
                yield here, tokens
                if copies_of(self.source, len(tokens)) > 1:
                    for due in self._copy_dues(epoch, index, fresh):
                        bisect.insort(copies, (due, text), key=lambda copy: copy[0])
                fresh += 1
            if start == 0 and index < self.dp_rank:
                raise ValueError(
                    f"{self.documents.description} has {index + 1} non-blank documents, so dp "
                    f"rank {self.dp_rank} of {self.dp_world_size} gets none; add documents or "
                    "lower the data-parallel degree"
                )
            epoch, start = epoch + 1, 0

    def read_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "documents": self._read, "sha256": self._hasher.hexdigest()}


class Mixture:
    """Several sources interleaved by tokens: the next document comes from the source with the
    least progress, its tokens drawn divided by its weight (the first on a tie). Every source's
    next item is read ahead, so a position names each one's next item."""

    def __init__(self, streams: Sequence[SourceStream]) -> None:
        self.streams = list(streams)

    def start(self) -> Position:
        return {
            "sources": [stream.start() for stream in self.streams],
            "progress": [0.0] * len(self.streams),
        }

    def position_in(self, state: dict[str, Any]) -> Position:
        """The position in a saved loader state; ValueError if it holds other sources."""
        saved = state.get("sources")
        if saved is None or len(saved) != len(self.streams):
            what = "one source" if saved is None else f"a mixture of {len(saved)} sources"
            raise ValueError(
                f"the loader state was saved reading {what}, but this job mixes "
                f"{len(self.streams)} ([[training.sources]]); resume with the sources it was "
                "saved with, or use another [job] dump_folder"
            )
        return {"sources": saved, "progress": state["progress"]}

    def items(self, position: Position) -> Iterator[tuple[Position, list[int]]]:
        progress = list(position["progress"])
        streams = [s.items(p) for s, p in zip(self.streams, position["sources"])]
        ahead = [next(stream) for stream in streams]  # each source's (position, tokens) next
        while True:
            chosen = min(range(len(ahead)), key=progress.__getitem__)
            tokens = ahead[chosen][1]
            yield {"sources": [p for p, _ in ahead], "progress": list(progress)}, tokens
            progress[chosen] += len(tokens) / self.streams[chosen].source.weight
            ahead[chosen] = next(streams[chosen])

    def read_state(self) -> dict[str, Any]:
        return {"sources": [stream.read_state() for stream in self.streams]}
