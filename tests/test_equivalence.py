"""UPipe / Ulysses over C gloo ranks == the unsharded torchtitan model: logits and every gradient.

Each spawn runs the whole grid for one CP degree C (spawning is the slow part on CPU): MHA and GQA
(n_rep 2 and 4), fewer KV heads than ranks, U in {C, 2C, H}, sequence lengths that are and are
not multiples of 2C, default and explicit (per-document) positions.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from harness import VOCAB, cast_parameters, gather_sequence, rel_err, run_on_ranks, shard, summed_grads, tiny_llama
from upipe_dtensor import UlyssesAttention, UPipeAttention
from upipe_dtensor.parallel.head_schedule import valid_heads_per_stage

FP32_TOL = 1e-5


def geometries(cp: int) -> list[tuple[int, int]]:
    """(n_heads, n_kv_heads): MHA, GQA n_rep 2 and 4, and KV heads < C where C allows it."""
    n_heads = 4 * max(cp, 2)
    geoms = [(n_heads, n_heads), (n_heads, n_heads // 2), (n_heads, n_heads // 4)]
    if cp > 1:
        geoms.append((n_heads, max(1, cp // 2)))
    return [g for g in geoms if valid_heads_per_stage(*g, cp)]


def cases(cp: int) -> list[dict]:
    out = []
    for n_heads, n_kv in geometries(cp):
        valid = valid_heads_per_stage(n_heads, n_kv, cp)
        for u in sorted({cp, 2 * cp, n_heads} & set(valid)):
            for seq_len in (4 * cp, 5 * cp):  # multiple of 2C, and not
                out.append(dict(n_heads=n_heads, n_kv=n_kv, u=u, seq_len=seq_len))
    return out


def _style(n_heads: int, u: int):
    return UlyssesAttention() if u == n_heads else UPipeAttention(heads_per_stage=u)


def _run_case(rank: int, cp: int, case: dict, dtype: torch.dtype, positions: bool) -> dict:
    seq_len = case["seq_len"]
    reference = tiny_llama(case["n_heads"], case["n_kv"], seq_len)
    model = copy.deepcopy(reference)
    truth = copy.deepcopy(reference)  # float32 reference, for the bf16 tolerance
    cast_parameters(reference, dtype)
    cast_parameters(model, dtype)
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, seq_len))
    probe = torch.randn(2, seq_len, VOCAB)
    full_positions = None
    if positions:  # two documents per row, positions restart at each document start
        cut = torch.tensor([[seq_len // 3], [seq_len // 2]])
        ar = torch.arange(seq_len).expand(2, -1)
        full_positions = torch.where(ar < cut, ar, ar - cut)

    def loss_and_logits(m, toks, pos, prb):
        logits = m(toks, positions=pos)
        (logits.float() * prb).sum().backward()
        return logits.detach().float()

    ref_logits = loss_and_logits(reference, tokens, full_positions, probe)
    mesh = init_device_mesh("cpu", (cp,))
    parallelize_module(model, mesh, {"layers.*.attention": _style(case["n_heads"], case["u"])})
    local_pos = None if full_positions is None else shard(full_positions, rank, cp)
    logits = gather_sequence(
        loss_and_logits(model, shard(tokens, rank, cp), local_pos, shard(probe, rank, cp))
    )
    grads = summed_grads(model)
    errors = {"logits": rel_err(logits, ref_logits)}
    errors.update({n: rel_err(grads[n], p.grad) for n, p in reference.named_parameters()})
    if dtype == torch.float32:
        return {k: (v, FP32_TOL) for k, v in errors.items()}
    # bf16: the sharded model may be no less accurate than the unsharded one (vs float32 truth).
    truth_logits = loss_and_logits(truth, tokens, full_positions, probe)
    result = {"logits": (rel_err(logits, truth_logits), 2 * rel_err(ref_logits, truth_logits) + 1e-2)}
    for n, p in truth.named_parameters():
        ref_grad = dict(reference.named_parameters())[n].grad
        result[n] = (rel_err(grads[n], p.grad), 2 * rel_err(ref_grad, p.grad) + 1e-2)
    return result


def _grid(rank: int, cp: int, dtype: torch.dtype) -> None:
    failures = []
    runs = [(c, False) for c in cases(cp)] + [(cases(cp)[0] | {"seq_len": 4 * cp}, True)]
    for case, positions in runs:
        for name, (err, tol) in _run_case(rank, cp, case, dtype, positions).items():
            if not err <= tol:
                failures.append(f"{case} positions={positions} {name}: rel err {err:.2e} > {tol:.1e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_matches_unsharded_model(cp: int, dtype: torch.dtype) -> None:
    run_on_ranks(cp, _grid, dtype)


def test_grid_covers_the_promised_cases() -> None:
    for cp in (2, 4):
        grid = cases(cp)
        assert {c["u"] for c in grid} >= {cp, 2 * cp, 4 * max(cp, 2)}
        assert any(c["n_kv"] < cp for c in grid)
        assert {c["n_heads"] // c["n_kv"] for c in grid} >= {1, 2, 4}
        assert any(c["seq_len"] % (2 * cp) for c in grid)
