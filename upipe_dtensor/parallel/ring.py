"""Ring attention over one process group, on the ring (zigzag) sequence layout.

Each of the R ring ranks holds its tokens in the layout of ``layouts.ring_positions``: an early
chunk (a = ceil(m/2) tokens) and a late chunk (m - a), m = S/R. K and V travel around the ring
(rank p sends to p+1, receives from p-1) while every rank attends its queries to the block it
holds, so after R steps each query has seen every key. The zigzag pairing makes the causal work
equal on all ranks, and each step is one of the kernel contract's two block kinds
(``kernels.attention``):

    step 0, own block                 : all queries x all keys, causal (diagonal)
    block of a rank o < p (earlier)   : all queries x o's early chunk, all visible (past)
    block of a rank o > p (later)     : p's late chunk of queries x all of o's keys (past)

Partial results are merged exactly through their log-sum-exp in float32 (``kernels.merge``).
Backward runs the same ring with the final output and LSE; dQ sums over the ring steps in a
float32 accumulator, and each block's dK/dV travel with it in float32 accumulators and arrive back
at their owner after the last step, returned as they are for the caller to add into its own.

The next block's send/receive is posted before the current block is computed, so on CUDA (NCCL
runs on its own stream) the transfer overlaps the attention; gloo on CPU runs the same code.
Document masks: each rank computes any block's document ids itself from the global ids and the
layout, so they never travel. Without a ring (R = 1) there is nothing of this: the callers call
the kernel itself (``staged_attention``).

Used by ``RingAttention`` (ring over the whole CP group) and by 2D UPipe/Ulysses (a ring across
nodes inside every head stage): one ring implementation.

Why not PyTorch's own ring (``torch.distributed.tensor.experimental.context_parallel``, whose
``_templated_ring_attention`` is private): it dispatches only the CUDA SDPA kernels (flash,
memory-efficient, cuDNN), so it has no CPU + gloo path to test on; it takes ``is_causal`` but no
mask, so no document masking; and it runs as its own autograd around SDPA calls, where every
style here must run inside one custom op that saves only the input, the output and the LSE, on a
sub-group (the ring axis of 2D) with the shared kernels' (out, lse) contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from upipe_dtensor.kernels.attention import attention_backward, attention_forward
from upipe_dtensor.kernels.merge import PartialAttention, accumulator
from upipe_dtensor.parallel.layouts import ring_halves, ring_positions
from upipe_dtensor.runtime.fake_process_group import fill_as_received
from upipe_dtensor.runtime.group_backends import stages_through_host

_KV_TAG, _GRAD_TAG = 1, 2


@dataclass(frozen=True)
class Ring:
    """This rank's place on a ring of ``size`` > 1 ranks."""

    group: dist.ProcessGroup
    rank: int
    size: int


class _Shift:
    """Send tensors to the next ring rank and receive the previous rank's, asynchronously."""

    def __init__(self, ring: Ring, tensors: tuple[Tensor, ...], tag: int) -> None:
        sent = tuple(t.contiguous() for t in tensors)
        self.received = tuple(torch.empty_like(t) for t in sent)
        # gloo has no send/recv of CUDA tensors (ranks sharing one GPU): through host copies
        self.staged = stages_through_host(ring.group, sent[0].device)
        self.sent = tuple(t.cpu() for t in sent) if self.staged else sent  # alive until sent
        self.landing = (
            tuple(torch.empty_like(t) for t in self.sent) if self.staged else self.received
        )
        after, before = (ring.rank + 1) % ring.size, (ring.rank - 1) % ring.size
        ops = [
            dist.P2POp(dist.isend, t, group=ring.group, group_peer=after, tag=tag)
            for t in self.sent
        ]
        ops += [
            dist.P2POp(dist.irecv, t, group=ring.group, group_peer=before, tag=tag)
            for t in self.landing
        ]
        self.requests = dist.batch_isend_irecv(ops)
        fill_as_received(self.landing, self.sent, ring.group)  # a stand-in run's fake group

    def wait(self) -> tuple[Tensor, ...]:
        for request in self.requests:
            request.wait()
        if self.staged:
            for into, landed in zip(self.received, self.landing):
                into.copy_(landed)
        self.sent = self.landing = ()
        return self.received


class _Blocks:
    """Which rows of the local queries meet which keys of the block owned by ``owner``."""

    def __init__(self, ring: Ring, seq_len: int, doc_ids: Tensor | None) -> None:
        self.ring, self.seq_len, self.doc_ids = ring, seq_len, doc_ids
        self.early, _ = ring_halves(seq_len, ring.size)

    def docs(self, owner: int) -> Tensor | None:
        if self.doc_ids is None:
            return None
        positions = ring_positions(self.seq_len, owner, self.ring.size, self.doc_ids.device)
        return self.doc_ids.index_select(1, positions)

    def spans(self, owner: int) -> tuple[slice, slice, bool]:
        """(query rows, key rows, causal) of the block owned by ``owner``."""
        everything = slice(None)
        if owner == self.ring.rank:
            return everything, everything, True
        if owner < self.ring.rank:
            return everything, slice(0, self.early), False
        return slice(self.early, None), everything, False


def _docs(ids: Tensor | None, rows: slice) -> Tensor | None:
    return None if ids is None else ids[:, rows]


def ring_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, backend: str, ring: Ring, doc_ids: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(out, lse) of this rank's queries over the whole ring's keys (module docstring).

    ``q``, ``k``, ``v`` are (B, m, h, d) in the ring layout; ``doc_ids`` is None or the (B, S)
    document ids of the whole sequence in global order.
    """
    seq_len = q.shape[1] * ring.size
    blocks = _Blocks(ring, seq_len, doc_ids)
    mine = blocks.docs(ring.rank)
    partial: PartialAttention | None = None
    kv = (k, v)
    for step in range(ring.size):
        owner = (ring.rank - step) % ring.size
        shift = _Shift(ring, kv, _KV_TAG) if step < ring.size - 1 else None
        rows, keys, causal = blocks.spans(owner)
        theirs = mine if owner == ring.rank else blocks.docs(owner)
        if q[:, rows].shape[1] and kv[0][:, keys].shape[1]:
            out, lse = attention_forward(
                q[:, rows],
                kv[0][:, keys],
                kv[1][:, keys],
                scale,
                backend,
                causal=causal,
                q_docs=_docs(mine, rows),
                k_docs=_docs(theirs, keys),
            )
            if partial is None:
                partial = PartialAttention(out, lse)
            else:
                partial.add(out, lse, start=rows.start or 0)
        if shift is not None:
            kv = shift.wait()
    return partial.result(q.dtype)


def ring_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    backend: str,
    ring: Ring,
    doc_ids: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``ring_attention_forward`` from its final ``out`` and ``lse``: dq in
    q's dtype (it goes through the all-to-all next); dk and dv, summed over the ring steps, in
    float32 (the caller adds them into its float32 dK/dV accumulators; no rounding in
    between)."""
    seq_len = q.shape[1] * ring.size
    blocks = _Blocks(ring, seq_len, doc_ids)
    mine = blocks.docs(ring.rank)
    grad_q = accumulator(q)
    kv, grad_shift = (k, v), None
    for step in range(ring.size):
        owner = (ring.rank - step) % ring.size
        shift = _Shift(ring, kv, _KV_TAG) if step < ring.size - 1 else None
        if grad_shift is None:  # this rank's own block: its accumulators start here
            grad_kv = accumulator(k), accumulator(v)
        else:  # the accumulators of ``owner``'s block, from the previous rank
            grad_kv = grad_shift.wait()
        rows, keys, causal = blocks.spans(owner)
        theirs = mine if owner == ring.rank else blocks.docs(owner)
        if q[:, rows].shape[1] and kv[0][:, keys].shape[1]:
            dq, dk, dv = attention_backward(
                grad_out[:, rows],
                q[:, rows],
                kv[0][:, keys],
                kv[1][:, keys],
                out[:, rows],
                lse[:, :, rows],
                scale,
                backend,
                causal=causal,
                q_docs=_docs(mine, rows),
                k_docs=_docs(theirs, keys),
            )
            grad_q[:, rows] += dq
            grad_kv[0][:, keys] += dk
            grad_kv[1][:, keys] += dv
            del dq, dk, dv  # the block's float32 gradients must not live on beside the next buffers
        grad_shift = _Shift(ring, grad_kv, _GRAD_TAG)
        if shift is not None:
            kv = shift.wait()
    grad_k, grad_v = grad_shift.wait()  # this rank's own block, back from its last visitor
    return grad_q.to(q.dtype), grad_k, grad_v
