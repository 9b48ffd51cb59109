"""The boundaries of document-masked attention blocks, computed once per step.

Every attention block of a document-masked step reads its boundaries from the step's (B, S)
document ids, which live in host memory: a diagonal block its documents (varlen ``cu_seqlens``
on the device, and the longest), a past block the one document its queries share with its keys.
The same blocks recur in every layer, stage, chunk and ring step, in forward, recompute and
backward; computed there each time they cost O(S) host work per block and, for ``cu_seqlens``, a
blocking host-to-device copy (``torch.tensor(list, device=cuda)`` copies from pageable memory
and synchronises the stream) per block. Here each is computed once per document-id tensor: the
values are kept beside the ids' storage (keyed by the view: offset, shape, strides and version)
and go with it, at the end of the step, and ``cu_seqlens`` travel once, pinned and non_blocking
(``host_store.to_device``).

Fake ids (the memory planner's, which have no values) describe one document per row: a diagonal
block is one varlen document per row, a past block shares everything. The planner so traces the
document path itself (its metadata, its copies, the varlen kernels) with the shapes of the
dense blocks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from upipe_dtensor.runtime.host_store import to_device
from upipe_dtensor.runtime.torch_private import is_fake, unset_fake_temporarily

T = TypeVar("T")

_ENTRIES: dict[int, tuple[weakref.ref, dict]] = {}
"""id(storage of document ids) -> (the storage, {(view, what): value})."""


def derived(docs: Tensor, what: tuple, compute: Callable[[], T]) -> T:
    """``compute()`` for this view of document ids and ``what``, computed once while the ids
    live (module docstring)."""
    storage = docs.untyped_storage()
    key = id(storage)
    entry = _ENTRIES.get(key)
    if entry is None or entry[0]() is not storage:
        entry = (weakref.ref(storage, lambda _ref, key=key: _ENTRIES.pop(key, None)), {})
        _ENTRIES[key] = entry
    view = (docs.storage_offset(), tuple(docs.shape), tuple(docs.stride()), docs._version)
    values = entry[1]
    if (view, what) not in values:
        values[(view, what)] = compute()
    return values[(view, what)]


def segments(docs: Tensor) -> list[list[tuple[int, int]]]:
    """[start, end) of every document of (B, L) ``docs``, per batch row."""
    return derived(docs, ("segments",), lambda: _segments(docs))


def _segments(docs: Tensor) -> list[list[tuple[int, int]]]:
    length = docs.shape[1]
    if is_fake(docs):
        return [[(0, length)] for _ in range(docs.shape[0])]
    rows = []
    with unset_fake_temporarily():
        for row in docs.cpu():
            cuts = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
            bounds = [0, *cuts, length]
            rows.append(list(zip(bounds[:-1], bounds[1:])))
    return rows


def varlen_seqlens(docs: Tensor, device: torch.device) -> tuple[Tensor, int]:
    """cu_seqlens of the documents of (B, L) ``docs`` packed row after row, as int32 on
    ``device``, and the longest document."""

    def compute() -> tuple[Tensor, int]:
        rows, length = segments(docs), docs.shape[1]
        bounds = [row * length + start for row, spans in enumerate(rows) for start, _ in spans]
        bounds.append(len(rows) * length)
        longest = max(end - start for spans in rows for start, end in spans)
        host = torch.tensor(bounds, dtype=torch.int32)  # host data, sent once without a sync
        return to_device(host, device), longest

    return derived(docs, ("varlen", str(device)), compute)


def shared_document(q_docs: Tensor, k_docs: Tensor) -> list[tuple[int, int]]:
    """Per row of a past block (every key before every query): (queries, keys) = the query
    prefix and key suffix of the one document that has both, or (0, 0)."""

    def compute() -> tuple[list[tuple[int, int]], Tensor]:
        if is_fake(q_docs) or is_fake(k_docs):
            return [(q_docs.shape[1], k_docs.shape[1])] * q_docs.shape[0], k_docs
        with unset_fake_temporarily():
            queries_ids, keys_ids = q_docs.cpu(), k_docs.cpu()
            common = keys_ids[:, -1:]
            queries = (queries_ids == common).sum(1) * (queries_ids[:, :1] == common).squeeze(1)
            keys = (keys_ids == common).sum(1) * (queries > 0)
            return list(zip(queries.tolist(), keys.tolist())), k_docs

    keys_view = (
        id(k_docs.untyped_storage()),
        k_docs.storage_offset(),
        tuple(k_docs.shape),
        tuple(k_docs.stride()),
        k_docs._version,
    )
    # The value holds ``k_docs``: its storage (and so its id in the key) lives as long as it.
    return derived(q_docs, ("shared", keys_view), compute)[0]
