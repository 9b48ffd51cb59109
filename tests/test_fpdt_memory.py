"""FPDT's device memory for attention does not grow with the number of earlier chunks: the rest
waits in host memory. Measured with the project's live-tensor tracker on the real FPDT op (run
transparently on fake tensors, with ``meta`` standing in for host memory, as the planner does).

For a fixed chunk size, doubling the number of chunks doubles the sequence; the op's transient
device memory (its peak beyond its inputs and outputs, forward and backward) must stay the same
while its host memory grows. From 3 earlier chunks on, the double buffer is full (one earlier
chunk in use, the next in flight), so 4, 8 and 16 chunks are compared. Ulysses on the same
sequences (one chunk) is the contrast.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.checkpoint import checkpoint

from upipe_dtensor.modes.ops import transparent_ops
from upipe_dtensor.parallel.attention_op import AttentionParams, AttentionWeights
from upipe_dtensor.parallel.fpdt_attention import fpdt_attention
from upipe_dtensor.planning.tracker import LiveMemoryTracker
from upipe_dtensor.runtime.host_store import HostMemory

pytestmark = pytest.mark.unit

HEADS, KV_HEADS, HEAD_DIM, CHUNK = 8, 4, 16, 256
DIM = 8  # narrow: the layer output (made after the chunk loop) stays below one chunk's work


def _transients(chunks: int, chunk_tokens: int) -> tuple[int, int, int]:
    """(forward transient, backward transient, host peak) in bytes, for one op on one rank."""
    seq_len = chunks * chunk_tokens
    host = HostMemory(torch.device("meta"))
    tracker = LiveMemoryTracker()
    with FakeTensorMode(), transparent_ops(), tracker:
        x = torch.empty(1, seq_len, DIM, requires_grad=True)
        weights = [
            torch.empty(h * HEAD_DIM, DIM, requires_grad=True) for h in (HEADS, KV_HEADS, KV_HEADS)
        ]
        weights.append(torch.empty(DIM, HEADS * HEAD_DIM, requires_grad=True))  # wo
        rope = torch.empty(seq_len, HEAD_DIM // 2, 2)
        tracker.start_step()
        start = tracker.totals["cpu"]
        params = AttentionParams(
            head_group="",
            head_degree=1,
            head_dim=HEAD_DIM,
            heads_per_stage=HEADS,
            chunks=chunks,
            scale=HEAD_DIM**-0.5,
            backend="sdpa",
            store_name=host.name,
        )
        # Checkpointed, as every long-context recipe runs it: backward recomputes the forward,
        # whose saved output then holds the query gradients (``AttentionParams
        # .output_is_scratch``).
        out = checkpoint(
            fpdt_attention, x, AttentionWeights(*weights), rope, None, params, use_reentrant=False
        )
        # Alive through the loop: the pre-wo output buffer and the LSEs (saved for backward). The
        # layer output y comes after the loop; it must be below the loop's own peak.
        saved = seq_len * HEADS * HEAD_DIM * 4 + _lse_bytes(seq_len)
        forward = tracker.peaks["cpu"].bytes - start - saved
        assert forward > out.nbytes
        grad = torch.empty_like(out)
        tracker.start_step()
        start = tracker.totals["cpu"]
        grads = torch.autograd.grad(out, [x, *weights], grad)
        # The recomputed forward's saved output and LSEs are backward's now.
        backward = tracker.peaks["cpu"].bytes - start - sum(g.nbytes for g in grads) - saved
    return forward, backward, tracker.peaks["meta"].bytes


def _lse_bytes(seq_len: int) -> int:
    return HEADS * seq_len * 4  # float32 log-sum-exp of every head and token, saved for backward


def test_device_memory_does_not_grow_with_earlier_chunks() -> None:
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    try:
        fpdt = {chunks: _transients(chunks, CHUNK) for chunks in (4, 8, 16)}
        ulysses = {chunks: _transients(1, chunks * CHUNK) for chunks in (4, 16)}
    finally:
        dist.destroy_process_group()
    forward, backward, host = zip(*(fpdt[c] for c in (4, 8, 16)))
    assert forward[0] == forward[1] == forward[2] > 0, forward
    assert backward[0] == backward[1] == backward[2] > 0, backward
    assert host[0] < host[1] < host[2], host  # the earlier chunks are there instead
    # One chunk (Ulysses) holds the whole sequence's K/V and queries: it grows 4x from 4 to 16.
    assert ulysses[16][0] > 3 * ulysses[4][0] and ulysses[16][1] > 3 * ulysses[4][1]
    assert fpdt[16][0] < ulysses[16][0] / 3 and fpdt[16][1] < ulysses[16][1] / 3
