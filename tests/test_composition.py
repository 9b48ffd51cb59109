"""Every CP style composed the way a trainer applies it: CP style, then per-block torch.compile,
then FSDP2 (over the whole CP mesh, 2D included).

Numbers must still equal the unsharded model (float32), and a fullgraph-compiled block must trace
without graph breaks (each style's loop is one opaque custom op with a fake implementation).
"""

from __future__ import annotations

import copy

import pytest
import torch
from harness import (
    VOCAB,
    cp_mesh,
    gather_sequence,
    make_style,
    rel_err,
    run_on_ranks,
    shard,
    summed_grads,
    tiny_llama,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

pytestmark = pytest.mark.distributed

TOL = 1e-5
SEQ_LEN = 16


CASES = {
    "upipe": dict(style="upipe"),
    "ulysses": dict(style="ulysses"),
    "ring": dict(style="ring"),
    "fpdt": dict(style="fpdt", chunks=2, seq_len=SEQ_LEN),
    "upipe_fpdt": dict(style="fpdt", u=2, chunks=2, seq_len=SEQ_LEN),  # UPipe x FPDT
    "upipe2d": dict(style="upipe2d", ring=2),
}


def _compose(rank: int, cp: int, style_name: str, compile_blocks: bool, fsdp: bool) -> None:
    reference = tiny_llama(n_heads=8, n_kv_heads=2, seq_len=SEQ_LEN)
    model = copy.deepcopy(reference)
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (1, SEQ_LEN))
    probe = torch.randn(1, SEQ_LEN, VOCAB)
    ref_logits = reference(tokens)
    (ref_logits * probe).sum().backward()

    case = CASES[style_name]
    style, mesh = make_style(case), cp_mesh(case, cp)
    parallelize_module(model, mesh, {"layers.*.attention": style})
    if mesh.ndim > 1:  # FSDP2 shards over the whole CP group, as the trainer does
        mesh = mesh._flatten("cp")
    if compile_blocks:
        for block in model.layers.values():
            block.compile(fullgraph=True)
    if fsdp:
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    logits = model(shard(tokens, rank, cp, style))
    (logits * shard(probe, rank, cp, style)).sum().backward()
    # Without FSDP each rank holds its shard's partial gradient and summed_grads() adds them up.
    # FSDP2 already reduced them to their mean over the cp ranks, so the same sum gives cp * mean.
    grads = summed_grads(model)

    errors = {"logits": rel_err(gather_sequence(logits.detach(), style), ref_logits.detach())}
    errors.update({n: rel_err(grads[n], p.grad) for n, p in reference.named_parameters()})
    bad = {n: e for n, e in errors.items() if not e <= TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"


def test_fsdp2() -> None:
    """Eager; every style is compiled with FSDP2 below (and eager with FSDP2 in the trainer's
    tests)."""
    run_on_ranks(2, _compose, "upipe", False, True)


def test_compile_fullgraph() -> None:
    run_on_ranks(2, _compose, "upipe", True, False)


@pytest.mark.parametrize("style_name", ["upipe", "ulysses", "ring", "fpdt", "upipe_fpdt"])
def test_compile_and_fsdp2(style_name: str) -> None:
    run_on_ranks(2, _compose, style_name, True, True)


def test_two_d_compile_and_fsdp2() -> None:
    """2D UPipe on 2 x 2 ranks (ring x heads), compiled and sharded over all four."""
    run_on_ranks(4, _compose, "upipe2d", True, True)
