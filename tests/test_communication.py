"""All-to-alls per layer: K/V travel once per KV block, not once per stage; the primitive is exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from harness import VOCAB, rel_err, run_on_ranks, shard, tiny_llama
from upipe_dtensor import UPipeAttention
from upipe_dtensor.parallel import all_to_all
from upipe_dtensor.parallel.head_schedule import make_head_schedule


def _count_all_to_alls(rank: int, cp: int, n_heads: int, n_kv: int, expected: dict) -> None:
    model = tiny_llama(n_heads, n_kv, seq_len=4 * cp, n_layers=1)
    parallelize_module(model, init_device_mesh("cpu", (cp,)), {"layers.*.attention": UPipeAttention()})
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
    heads = all_to_all.sequence_to_heads(local, group, cp)
    per_rank = full.shape[2] // cp
    assert torch.equal(heads, full[:, :, rank * per_rank : (rank + 1) * per_rank])
    assert torch.equal(all_to_all.heads_to_sequence(heads, group, cp), local)

    # The differentiable ops inside a fullgraph compile: gradient of sum(w * y) is w moved back.
    name = group.group_name
    x = local.clone().requires_grad_()
    weight = torch.randn_like(heads)
    fn = torch.compile(
        lambda t: (all_to_all.seq_to_head(t, name, cp) * weight).sum(), fullgraph=True, backend="aot_eager"
    )
    fn(x).backward()
    assert rel_err(x.grad, all_to_all.heads_to_sequence(weight, group, cp)) == 0.0


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_sequence_head_all_to_all(cp: int) -> None:
    run_on_ranks(cp, _round_trip)
