"""Every CP style over C gloo ranks == the unsharded torchtitan model: logits and every gradient.

Each spawn runs the whole grid for one CP degree C (spawning is the slow part on CPU):
- UPipe / Ulysses: MHA and GQA (n_rep 2 and 4), fewer KV heads than ranks, U in {C, 2C, H},
  sequence lengths that are and are not multiples of 2C, explicit (per-document) positions;
  stages overlapped (the default) and once each exchange waited at once;
- ring attention: the same geometries and lengths (its zigzag layout takes any S divisible by C);
- FPDT: 1, 2 and 4 chunks per rank, and UPipe x FPDT (U = C with chunks);
- 2D (ring x heads): every (R, C/R) the degree allows, U in {C/R, H};
- document masks for every style, with global and per-document RoPE positions, against the
  unsharded model run one document at a time;
- long shards (more tokens per rank than the model's width), where backward adds each stage's
  query gradients into dx and dwq at once instead of keeping them for one product at the end
  (``AttentionProjections.query_grads_wait``): UPipe at U = C and 2C, FPDT, UPipe x FPDT and
  Qwen3's QK-norm, in float32 and bfloat16.
In float32 the relative error must be <= 1e-5; in bfloat16 the sharded model may be no less
accurate against a float32 reference than the unsharded bf16 model (2x its error + 1e-2).
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from harness import (
    VOCAB,
    case_meshes,
    cast_parameters,
    gather_sequence,
    make_style,
    rel_err,
    run_on_ranks,
    shard,
    summed_grads,
    tiny_llama,
    tiny_qwen3,
)
from torch.distributed.tensor.parallel import parallelize_module

from upipe_dtensor.data.documents import document_positions
from upipe_dtensor.models.tensor_parallel import apply_tensor_parallel
from upipe_dtensor.parallel.head_schedule import valid_heads_per_stage
from upipe_dtensor.parallel.staged_attention import AttentionProjections

pytestmark = pytest.mark.distributed

FP32_TOL = 1e-5


def geometries(cp: int) -> list[tuple[int, int]]:
    """(n_heads, n_kv_heads): MHA, GQA n_rep 2 and 4, and KV heads < C where C allows it."""
    n_heads = 4 * max(cp, 2)
    geoms = [(n_heads, n_heads), (n_heads, n_heads // 2), (n_heads, n_heads // 4)]
    if cp > 1:
        geoms.append((n_heads, max(1, cp // 2)))
    return [g for g in geoms if valid_heads_per_stage(*g, cp)]


def ulysses_cases(cp: int) -> list[dict]:
    out = []
    for n_heads, n_kv in geometries(cp):
        valid = valid_heads_per_stage(n_heads, n_kv, cp)
        for u in sorted({cp, 2 * cp, n_heads} & set(valid)):
            for seq_len in (4 * cp, 5 * cp):  # multiple of 2C, and not
                style = "ulysses" if u == n_heads else "upipe"
                out.append(dict(style=style, n_heads=n_heads, n_kv=n_kv, u=u, seq_len=seq_len))
    # UPipe overlaps its stages' exchanges by default; once with each exchange waited at once
    n_heads, n_kv = geometries(cp)[1]
    out.append(dict(style="upipe", n_heads=n_heads, n_kv=n_kv, u=cp, seq_len=4 * cp, overlap=False))
    return out


def ring_cases(cp: int) -> list[dict]:
    # Ring has no head constraint: also fewer KV heads than ranks without replication.
    geoms = [(4, 4), (4, 2), (4, 1)]
    return [
        dict(style="ring", n_heads=h, n_kv=kv, seq_len=s)
        for h, kv in geoms
        for s in (4 * cp, 5 * cp)
    ]


def fpdt_cases(cp: int) -> list[dict]:
    out = []
    for n_heads, n_kv in geometries(cp)[1:3]:  # GQA n_rep 2 and 4
        for chunks in (1, 2, 4):
            out.append(
                dict(style="fpdt", n_heads=n_heads, n_kv=n_kv, chunks=chunks, seq_len=4 * cp)
            )
    n_heads, n_kv = geometries(cp)[-1]  # fewest KV heads; not a multiple of 2C; UPipe x FPDT
    out.append(dict(style="fpdt", n_heads=n_heads, n_kv=n_kv, chunks=1, seq_len=5 * cp))
    out.append(dict(style="fpdt", n_heads=n_heads, n_kv=n_kv, chunks=2, u=cp, seq_len=4 * cp))
    return out


def two_d_cases(cp: int) -> list[dict]:
    out = []
    for ring in (r for r in range(2, cp + 1) if cp % r == 0):
        heads = cp // ring
        n_heads = 4 * max(heads, 2)
        for n_kv in sorted({n_heads // 2, max(1, heads // 2)}):
            for u in sorted({heads, n_heads}):
                for seq_len in (4 * cp, 5 * cp):
                    style = "ulysses2d" if u == n_heads else "upipe2d"
                    out.append(
                        dict(
                            style=style, ring=ring, n_heads=n_heads, n_kv=n_kv, u=u, seq_len=seq_len
                        )
                    )
    return out


def document_cases(cp: int) -> list[dict]:
    """Every style once with documents, in both RoPE position modes."""
    h = 4 * max(cp, 2)
    styles = [
        dict(style="upipe", n_heads=h, n_kv=max(1, cp // 2), u=cp),  # KV heads < C
        dict(style="ulysses", n_heads=h, n_kv=h // 2, u=h),
        dict(style="ring", n_heads=4, n_kv=2),
        dict(style="fpdt", n_heads=h, n_kv=h // 4, chunks=2),
    ]
    if cp >= 2:
        styles.append(dict(style="upipe2d", ring=2, n_heads=8, n_kv=2, u=cp // 2))
    return [s | dict(seq_len=4 * cp, docs=mode) for s in styles for mode in ("global", "document")]


def cases(cp: int, dtype: torch.dtype) -> list[dict]:
    grid = (
        ulysses_cases(cp) + ring_cases(cp) + fpdt_cases(cp) + two_d_cases(cp) + document_cases(cp)
    )
    if dtype != torch.float32:  # bf16: UPipe/Ulysses in full, the other styles once each
        seen, subset = set(), []
        for case in grid:
            key = case["style"] if case["style"] not in ("upipe", "ulysses") else len(subset)
            if key not in seen:
                seen.add(key)
                subset.append(case)
        grid = subset
    return grid


def document_ids(seq_len: int) -> torch.Tensor:
    """Two rows: one-token documents, one straddling rank boundaries, one longer than a shard."""
    ids = torch.zeros(2, seq_len, dtype=torch.int32)
    for row, cuts in enumerate(((1, 2, seq_len // 2 + 1), (seq_len - 1,))):
        for cut in cuts:
            ids[row, cut:] += 1
    return ids


def _reference_logits(model, tokens, positions, doc_ids):
    """The unsharded model; with documents, run one document at a time (its own sequence)."""
    if doc_ids is None:
        return model(tokens, positions=positions)
    rows = []
    for row in range(tokens.shape[0]):
        pieces, ids = [], doc_ids[row]
        cuts = [0, *(torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist(), tokens.shape[1]]
        for start, end in zip(cuts[:-1], cuts[1:]):
            pos = positions[row : row + 1, start:end]
            pieces.append(model(tokens[row : row + 1, start:end], positions=pos))
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows)


def _run_case(rank: int, world: int, case: dict, dtype: torch.dtype) -> dict:
    """One case on the ``world`` ranks, cp x its "tp" (tensor parallelism under the style):
    relative errors of the logits and every gradient against the unsharded model, with their
    tolerances."""
    cp = world // case.get("tp", 1)
    seq_len = case["seq_len"]
    build = tiny_qwen3 if case.get("family") == "qwen3" else tiny_llama
    reference = build(case["n_heads"], case["n_kv"], seq_len)
    model = copy.deepcopy(reference)
    truth = copy.deepcopy(reference)  # float32 reference, for the bf16 tolerance
    cast_parameters(reference, dtype)
    cast_parameters(model, dtype)
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, seq_len))
    probe = torch.randn(2, seq_len, VOCAB)
    doc_ids = document_ids(seq_len) if case.get("docs") else None
    positions = None
    if case.get("positions") or case.get("docs") == "document":  # restart at each document start
        ids = doc_ids if doc_ids is not None else document_ids(seq_len)
        positions = document_positions(ids)
    ref_positions = positions if positions is not None else torch.arange(seq_len).expand(2, -1)

    def loss_and_logits(m, toks, pos, prb, docs=None, reference_run=False):
        logits = (
            _reference_logits(m, toks, pos, docs)
            if reference_run
            else m(toks, attention_masks=docs, positions=pos)
        )
        (logits.float() * prb).sum().backward()
        return logits.detach().float()

    ref_logits = loss_and_logits(
        reference, tokens, ref_positions, probe, doc_ids, reference_run=True
    )
    style = make_style(case)
    mesh, tp_mesh, group, cp_rank = case_meshes(case, cp)
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh, logits=True)
    parallelize_module(model, mesh, {"layers.*.attention": style})
    local_pos = None if positions is None else shard(positions, cp_rank, cp, style)
    local_logits = loss_and_logits(
        model,
        shard(tokens, cp_rank, cp, style),
        local_pos,
        shard(probe, cp_rank, cp, style),
        doc_ids,
    )
    logits = gather_sequence(local_logits, style, group)
    grads = summed_grads(model, group)
    errors = {"logits": rel_err(logits, ref_logits)}
    errors.update({n: rel_err(grads[n], p.grad) for n, p in reference.named_parameters()})
    if dtype == torch.float32:
        return {k: (v, FP32_TOL) for k, v in errors.items()}
    # bf16: the sharded model may be no less accurate than the unsharded one (vs float32 truth):
    # within ``bf16_factor`` (default 2) times its error, plus ``bf16_slack`` (default 1e-2).
    factor, slack = case.get("bf16_factor", 2.0), case.get("bf16_slack", 1e-2)
    truth_logits = loss_and_logits(truth, tokens, ref_positions, probe, doc_ids, reference_run=True)
    result = {
        "logits": (
            rel_err(logits, truth_logits),
            factor * rel_err(ref_logits, truth_logits) + slack,
        )
    }
    for n, p in truth.named_parameters():
        ref_grad = dict(reference.named_parameters())[n].grad
        result[n] = (rel_err(grads[n], p.grad), factor * rel_err(ref_grad, p.grad) + slack)
    return result


def _grid(rank: int, cp: int, dtype: torch.dtype, grid: list[dict]) -> None:
    failures = []
    for case in grid:
        for name, (err, tol) in _run_case(rank, cp, case, dtype).items():
            if not err <= tol:
                failures.append(f"{case} {name}: rel err {err:.2e} > {tol:.1e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "cp,dtype",
    [
        (1, torch.float32),
        (1, torch.bfloat16),
        (2, torch.float32),
        (2, torch.bfloat16),
        (4, torch.float32),
        pytest.param(4, torch.bfloat16, marks=pytest.mark.slow),  # bf16 at 4: test_bf16.py
    ],
    ids=["1-fp32", "1-bf16", "2-fp32", "2-bf16", "4-fp32", "4-bf16"],
)
def test_matches_unsharded_model(cp: int, dtype: torch.dtype) -> None:
    grid = cases(cp, dtype) + [ulysses_cases(cp)[0] | {"seq_len": 4 * cp, "positions": True}]
    run_on_ranks(cp, _grid, dtype, grid)


def test_three_ranks_ring_and_fpdt() -> None:
    """C = 3, where the methods allow it: ring (any heads) and FPDT (6 heads over 3 ranks)."""
    grid = [dict(style="ring", n_heads=4, n_kv=2, seq_len=s) for s in (6, 9)]
    grid += [
        dict(style="fpdt", n_heads=6, n_kv=kv, chunks=c, seq_len=12) for kv, c in ((3, 2), (6, 4))
    ]
    grid += [dict(style="ring", n_heads=4, n_kv=1, seq_len=12, docs="document")]
    run_on_ranks(3, _grid, torch.float32, grid)


def test_eight_ranks_as_two_by_four() -> None:
    """2D with a ring of 2 and a head axis of 4 (8 processes, so two cases): UPipe with fewer KV
    heads than the head axis at a length that is not a multiple of 2C, and Ulysses-2D (U = H)."""
    grid = [
        dict(style="upipe2d", ring=2, n_heads=16, n_kv=2, u=4, seq_len=40),
        dict(style="ulysses2d", ring=2, n_heads=16, n_kv=8, u=16, seq_len=32),
    ]
    run_on_ranks(8, _grid, torch.float32, grid)


def tensor_parallel_cases() -> list[dict]:
    """Every style on cp 2 x tp 2: Llama3 and Qwen3 (QK-norm), GQA (and fewer KV heads per
    tensor-parallel rank than cp ranks: replicated), causal and packed documents."""
    grid = [
        dict(style="upipe", n_heads=8, n_kv=4, u=2),
        dict(style="upipe", n_heads=8, n_kv=2, u=2, family="qwen3"),  # 1 KV head per tp rank
        dict(style="ulysses", n_heads=8, n_kv=4, u=8, docs="document"),
        dict(style="ring", n_heads=8, n_kv=2, docs="global"),
        dict(style="fpdt", n_heads=8, n_kv=4, chunks=2, family="qwen3"),
        dict(style="fpdt", n_heads=8, n_kv=4, chunks=2, u=2, docs="document"),  # UPipe x FPDT
        dict(style="upipe2d", ring=2, n_heads=8, n_kv=4, u=1, family="qwen3"),
        dict(style="upipe", n_heads=8, n_kv=4, u=2, family="qwen3", docs="global"),
    ]
    return [case | dict(tp=2, seq_len=16) for case in grid]


def test_tensor_parallel_under_every_style() -> None:
    """cp 2 x tp 2 (4 processes, tp innermost): torchtitan's tensor-parallel layout (column-wise
    Q/K/V, row-wise wo and MLP, sequence-parallel norms) with each style over cp on every tensor-
    parallel rank's heads equals the unsharded model: logits and every gradient (the tp shards
    gathered, the replicated weights' partial sums reduced)."""
    run_on_ranks(4, _grid, torch.float32, tensor_parallel_cases())


def test_grid_covers_the_promised_cases() -> None:
    for cp in (2, 4):
        grid = cases(cp, torch.float32)
        ulysses = [c for c in grid if c["style"] in ("upipe", "ulysses")]
        assert {c["u"] for c in ulysses} >= {cp, 2 * cp, 4 * max(cp, 2)}
        assert any(c["n_kv"] < cp for c in ulysses)
        assert {c["n_heads"] // c["n_kv"] for c in ulysses} >= {1, 2, 4}
        assert any(c["seq_len"] % (2 * cp) for c in ulysses)
        assert {c["chunks"] for c in grid if c["style"] == "fpdt"} == {1, 2, 4}
        assert any(c["n_kv"] < cp for c in grid if c["style"] == "ring")
        assert {(c["style"], c["docs"]) for c in grid if "docs" in c} >= {
            (s, m)
            for s in ("upipe", "ulysses", "ring", "fpdt", "upipe2d")
            for m in ("global", "document")
        }
    assert {c["ring"] for c in two_d_cases(4)} == {2, 4}
    assert any(c.get("overlap") is False for c in ulysses_cases(2))


def _grid_adding_queries_at_once(rank: int, cp: int, dtype: torch.dtype, grid: list[dict]) -> None:
    """``_grid``, checking that every stage's query gradient went into dx and dwq at once."""
    waited = []
    store = AttentionProjections.store_query_grad

    def spy(self, grad_q, stage, rope, waiting, grad_x, grad_wq):
        waited.append(waiting is not None)
        return store(self, grad_q, stage, rope, waiting, grad_x, grad_wq)

    with mock.patch.object(AttentionProjections, "store_query_grad", spy):
        _grid(rank, cp, dtype, grid)
    assert waited and not any(waited), "a case kept its query gradients for the end"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_query_gradients_added_at_once(dtype: torch.dtype) -> None:
    """192 tokens per rank against a width of 64 (MHA, 8 heads of 8): without checkpointing, dx
    and dwq then hold less than dx and a buffer of every query gradient, so each stage's goes
    into them at once (issue 40). Not U = 2C in bf16: with two KV blocks the waiting dx stays
    bf16, and a bf16 buffer and dx hold what one float32 dx does, so the queries wait."""
    long = dict(n_heads=8, n_kv=8, seq_len=384)
    grid = [
        dict(style="upipe", u=2, **long),
        dict(style="fpdt", chunks=4, **long),
        dict(style="fpdt", chunks=2, u=2, **long),
        dict(style="upipe", u=2, family="qwen3", **long),
    ]
    if dtype == torch.float32:
        grid.append(dict(style="upipe", u=4, **long))
    run_on_ranks(2, _grid_adding_queries_at_once, dtype, grid)
