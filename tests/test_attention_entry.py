"""The styles' op-level entry, ``ContextParallelAttention.attention(q, k, v, mesh)``, against
torch's own SDPA on the whole sequence, and a layer with frozen weights against the same layer
trainable.

Every style (UPipe at U = C and 2C, stages in turn and overlapped, Ulysses, ring attention, 2D UPipe
on a (cp_ring, cp_heads) mesh, FPDT in 4 chunks, UPipe x FPDT in 2) on 4 gloo ranks, float64, in
three geometries: GQA with 2 KV heads per rank, fewer KV heads than ranks (replicated), MHA;
plus documents. The output,
the LSE (against ``torch.logsumexp`` of the masked scores) and dq, dk, dv (summed over the
ranks) equal the reference's to float64 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import llama3_attention, run_on_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from upipe_dtensor import FPDTAttention, RingAttention, UlyssesAttention, UPipeAttention
from upipe_dtensor.data.documents import document_ids

pytestmark = pytest.mark.distributed

C = 4
SEQ, HEAD_DIM = 64, 8


def _reference(q, k, v, doc_ids):
    """torch's SDPA and the LSE of the (causal, same-document) scores, (B, S, H, d) in and out."""
    n_rep = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kt, vt = kt.repeat_interleave(n_rep, 1), vt.repeat_interleave(n_rep, 1)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    if doc_ids is not None:
        mask = mask & (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    scores = (qt @ kt.transpose(-1, -2)) * HEAD_DIM**-0.5
    lse = scores.masked_fill(~mask, float("-inf")).logsumexp(-1)
    return out.transpose(1, 2), lse


def _entry_matches_sdpa(rank: int, world: int) -> None:
    one_d = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    two_d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("cp_ring", "cp_heads"))
    styles = [
        (UPipeAttention(ring_degree=1), one_d),
        (UPipeAttention(heads_per_stage=2 * world, ring_degree=1), one_d),
        (UPipeAttention(ring_degree=1, overlap_stages=True), one_d),
        (UlyssesAttention(ring_degree=1), one_d),
        (RingAttention(), one_d),
        (UPipeAttention(ring_degree=2), two_d),
        (FPDTAttention(chunk_tokens=SEQ // 4), one_d),
        (UPipeAttention(chunk_tokens=SEQ // 2), one_d),
    ]
    for n_heads, n_kv_heads, documents in ((16, 8, False), (8, 2, False), (8, 8, True)):
        torch.manual_seed(n_heads + n_kv_heads)
        q = torch.randn(1, SEQ, n_heads, HEAD_DIM, dtype=torch.float64, requires_grad=True)
        k = torch.randn(1, SEQ, n_kv_heads, HEAD_DIM, dtype=torch.float64, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        grad = torch.randn_like(q)
        doc_ids = None
        if documents:
            tokens = torch.randint(1, 9, (1, SEQ))
            tokens[0, [10, 30, 31]] = 0  # documents end after token 10 and 31 (one is empty)
            doc_ids = document_ids(tokens, eos_id=0)
        out, lse = _reference(q, k, v, doc_ids)
        out.backward(grad)
        for style, mesh in styles:
            index = style.shard_positions(SEQ, rank, world)
            shards = [t.detach()[:, index].clone().requires_grad_() for t in (q, k, v)]
            got, got_lse = style.attention(*shards, mesh, document_ids=doc_ids)
            got.backward(grad[:, index])
            what = f"{style!r}, {n_heads}/{n_kv_heads} heads, documents {documents}"
            assert got_lse.shape == (1, n_heads, SEQ // world), what
            torch.testing.assert_close(got, out.detach()[:, index], msg=what)
            torch.testing.assert_close(got_lse, lse[..., index], msg=what)
            for shard, whole in zip(shards, (q, k, v)):
                summed = torch.zeros_like(whole)
                summed[:, index] = shard.grad
                dist.all_reduce(summed)
                torch.testing.assert_close(summed, whole.grad, msg=what)


def test_entry_equals_sdpa_for_every_style() -> None:
    run_on_ranks(C, _entry_matches_sdpa)


def _frozen_layer_matches_trainable(rank: int, world: int, style: str) -> None:
    """A tiny Llama's attention (this project's, called as its block calls it) with every weight
    frozen: the same dx as trainable, no weight gradient formed (autograd gets None from the
    op)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    results = []
    for frozen in (False, True):
        attention, args, kwargs = llama3_attention(8, 2, SEQ, head_dim=HEAD_DIM)
        made = {"upipe": UPipeAttention, "ulysses": UlyssesAttention, "ring": RingAttention}
        parallelize_module(attention, mesh, made[style]())
        for p in attention.parameters():
            p.requires_grad_(not frozen)
        torch.manual_seed(1)
        x = torch.randn(1, SEQ // world, 8 * HEAD_DIM, requires_grad=True)
        attention(x, *args, **kwargs).square().sum().backward()
        results.append(x.grad)
        grads = [p.grad for p in attention.parameters()]
        assert all((g is None) == frozen for g in grads), (style, frozen)
    torch.testing.assert_close(results[1], results[0])


@pytest.mark.parametrize("style", ["upipe", "ulysses", "ring"])
def test_frozen_weights_give_the_trainable_dx_and_no_weight_gradient(style: str) -> None:
    run_on_ranks(2, _frozen_layer_matches_trainable, style)
