"""Communication per layer: K/V travel once per KV block, not once per stage; the all-to-all is
exact; and every style sends exactly the bytes ``upipe_dtensor.planning.communication_volume`` says
it does."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import VOCAB, cp_mesh, make_style, run_on_ranks, shard, tiny_llama
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from upipe_dtensor import UPipeAttention
from upipe_dtensor.parallel import all_to_all
from upipe_dtensor.parallel.head_schedule import make_head_schedule
from upipe_dtensor.planning.communication_volume import layer_traffic

pytestmark = pytest.mark.distributed


def _count_all_to_alls(rank: int, cp: int, n_heads: int, n_kv: int, expected: dict) -> None:
    model = tiny_llama(n_heads, n_kv, seq_len=4 * cp, n_layers=1)
    parallelize_module(
        model, init_device_mesh("cpu", (cp,)), {"layers.*.attention": UPipeAttention()}
    )
    calls = []
    real = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_to_all_single = counting
    try:
        tokens = shard(torch.randint(0, VOCAB, (1, 4 * cp)), rank, cp)
        logits = model(tokens)
        forward = len(calls)
        logits.sum().backward()
        backward = len(calls) - forward
    finally:
        dist.all_to_all_single = real
    assert {"forward": forward, "backward": backward} == expected


@pytest.mark.parametrize("n_heads,n_kv", [(8, 2), (16, 4), (8, 1)])
def test_kv_is_exchanged_once_per_kv_block(n_heads: int, n_kv: int) -> None:
    cp = 2
    schedule = make_head_schedule(n_heads, n_kv, cp, cp)
    stages, blocks = len(schedule.stages), schedule.n_kv_blocks
    assert blocks < stages  # otherwise the test could not tell the two schedules apart
    # Forward: Q in and output back per stage; K and V once per block.
    # Backward: Q, output and its gradient in, dQ back per stage; K, V in and dK, dV back per block.
    expected = {"forward": 2 * stages + 2 * blocks, "backward": 4 * stages + 4 * blocks}
    run_on_ranks(cp, _count_all_to_alls, n_heads, n_kv, expected)


def _round_trip(rank: int, cp: int) -> None:
    group = dist.group.WORLD
    torch.manual_seed(0)
    full = torch.randn(2, 6 * cp, 2 * cp, 4)  # (B, S, h, d), identical on every rank
    local = shard(full, rank, cp)
    per_rank = full.shape[2] // cp
    own_heads = full[:, :, rank * per_rank : (rank + 1) * per_rank]
    # Two exchanges in flight at once, waited for in the other order, as the staged op overlaps
    # a stage's exchanges: each lands in its own layout.
    to_heads = all_to_all.start_sequence_to_heads(local, group, cp)
    to_sequence = all_to_all.start_heads_to_sequence(own_heads, group, cp)
    assert torch.equal(to_sequence.result(), local)
    heads = to_heads.result()
    assert torch.equal(heads, own_heads)
    # Each direction undoes the other, so each is the other's gradient (a permutation's adjoint
    # is its inverse).
    back = all_to_all.start_heads_to_sequence(heads, group, cp).result()
    assert torch.equal(back, local)
    assert torch.equal(all_to_all.start_sequence_to_heads(back, group, cp).result(), heads)
    if cp == 1:  # nothing to exchange: the input itself
        assert all_to_all.start_sequence_to_heads(local, group, cp).result() is local


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_sequence_head_all_to_all(cp: int) -> None:
    run_on_ranks(cp, _round_trip)


TRAFFIC_SEQ, TRAFFIC_BATCH, HEAD_DIM = 48, 2, 8


def _traffic_cases(cp: int) -> list[dict]:
    cases = [
        dict(style="upipe", n_heads=8, n_kv=2),
        dict(style="ulysses", n_heads=8, n_kv=2),
        dict(style="ring", n_heads=4, n_kv=1),
        dict(style="fpdt", n_heads=8, n_kv=4, chunks=3),
    ]
    if cp == 4:
        cases += [
            dict(style="upipe2d", ring=2, n_heads=8, n_kv=2),
            dict(style="ulysses2d", ring=2, n_heads=8, n_kv=8),
        ]
    return [c | dict(seq_len=TRAFFIC_SEQ) for c in cases]


def _count_bytes(rank: int, cp: int) -> None:
    """Count what this rank sends for one layer's forward and backward, per axis."""
    sent = {"a2a": 0, "p2p": 0}
    real_a2a, real_batch = dist.all_to_all_single, dist.batch_isend_irecv

    def a2a(output, input, *args, group=None, **kwargs):
        size = dist.get_world_size(group)
        sent["a2a"] += input.numel() * input.element_size() * (size - 1) // size
        return real_a2a(output, input, *args, group=group, **kwargs)

    def batch(ops):
        sent["p2p"] += sum(op.tensor.nbytes for op in ops if op.op.__name__ == "isend")
        return real_batch(ops)

    failures = []
    for case in _traffic_cases(cp):
        model = tiny_llama(
            case["n_heads"], case["n_kv"], TRAFFIC_SEQ, head_dim=HEAD_DIM, n_layers=1
        )
        style = make_style(case)
        parallelize_module(model, cp_mesh(case, cp), {"layers.*.attention": style})
        tokens = shard(torch.randint(0, VOCAB, (TRAFFIC_BATCH, TRAFFIC_SEQ)), rank, cp, style)
        dist.all_to_all_single, dist.batch_isend_irecv = a2a, batch
        try:
            sent.update(a2a=0, p2p=0)
            logits = model(tokens)
            forward = dict(sent)
            sent.update(a2a=0, p2p=0)
            logits.sum().backward()
            backward = dict(sent)
        finally:
            dist.all_to_all_single, dist.batch_isend_irecv = real_a2a, real_batch
        ring = case.get("ring", 1)
        u = case.get("u") or (
            cp // ring if case["style"] in ("upipe", "upipe2d") else case["n_heads"]
        )
        expected = layer_traffic(
            case["style"].removesuffix("2d"),
            seq_len=TRAFFIC_SEQ,
            batch=TRAFFIC_BATCH,
            cp=cp,
            ring_degree=ring,
            n_heads=case["n_heads"],
            n_kv_heads=case["n_kv"],
            head_dim=HEAD_DIM,
            heads_per_stage=u,
            dtype_bytes=4,
        )
        counted = (forward["a2a"], backward["a2a"], forward["p2p"], backward["p2p"])
        formula = (
            expected.forward_all_to_all,
            expected.backward_all_to_all,
            expected.forward_ring,
            expected.backward_ring,
        )
        if counted != formula:
            failures.append(f"{case}: counted {counted} != formula {formula}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("cp", [2, 4])
def test_bytes_sent_match_the_formula(cp: int) -> None:
    run_on_ranks(cp, _count_bytes)
