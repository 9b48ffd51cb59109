"""Tiled SwiGLU MLP: same numbers as torchtitan's FeedForward, compiles as one node, less memory.

The model tests run torchtitan's own Llama3 of the installed generation (``harness.tiny_llama``),
whose MLP is the ``llama3`` family's registered class."""

from __future__ import annotations

import copy
import json
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from harness import rel_err, tiny_llama
from torch._dynamo.backends.common import aot_autograd
from torch.profiler import ProfilerActivity, profile

from upipe_dtensor.memory import tiled_mlp
from upipe_dtensor.memory.tiled_mlp import apply_tiled_mlp, tiled_mlp_class, tiled_swiglu
from upipe_dtensor.models import get_family

pytestmark = pytest.mark.unit


def _weights(dim: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = ((hidden, dim), (dim, hidden), (hidden, dim))  # w1, w2, w3
    return [
        (torch.randn(s, generator=gen) * s[1] ** -0.5).to(dtype).requires_grad_() for s in shapes
    ]


def _plain(x, w1, w2, w3):
    """torchtitan FeedForward.forward with the same weights."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def _run(fn, x, weights, grad):
    """Output and the gradients of (x, w1, w2, w3) of ``fn`` for the upstream gradient ``grad``."""
    inputs = [t.detach().clone().requires_grad_() for t in (x, *weights)]
    out = fn(*inputs)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in inputs]


SHAPES = [
    # (leading dims, D, F, tile_tokens)
    ((1, 40), 16, 48, 16),  # 40 tokens in tiles of 16: last tile partial
    ((3, 10), 16, 48, 7),  # batch > 1, 30 tokens, tile 7
    ((2, 8), 32, 96, 64),  # 16 tokens: one tile bigger than the input
    ((2, 8), 32, 96, 16),  # exactly one tile
    ((24,), 8, 24, 1),  # 2-D input, one token per tile
]


@pytest.mark.parametrize("lead, dim, hidden, tile", SHAPES)
def test_matches_plain_float32(lead, dim, hidden, tile) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*lead, dim, generator=gen)
    grad = torch.randn(*lead, dim, generator=gen)
    weights = _weights(dim, hidden, torch.float32)
    expected = _run(_plain, x, weights, grad)
    actual = _run(lambda *a: tiled_swiglu(*a, tile_tokens=tile), x, weights, grad)
    for name, a, e in zip(("out", "dx", "dw1", "dw2", "dw3"), actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        assert rel_err(a, e) < 1e-5, (name, rel_err(a, e))


@pytest.mark.parametrize("tile", [1, 13, 96])  # 96 tiles (float32 accumulation matters), 8, one
def test_bfloat16_within_rounding(tile) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 48, 64, generator=gen)
    grad = torch.randn(2, 48, 64, generator=gen)
    weights = _weights(64, 192, torch.float32)
    reference = _run(_plain, x, weights, grad)
    bf16 = [w.detach().bfloat16() for w in weights]
    plain = _run(_plain, x.bfloat16(), bf16, grad.bfloat16())
    tiled = _run(lambda *a: tiled_swiglu(*a, tile_tokens=tile), x.bfloat16(), bf16, grad.bfloat16())
    for name, t, p, r in zip(("out", "dx", "dw1", "dw2", "dw3"), tiled, plain, reference):
        assert t.dtype == torch.bfloat16, name
        assert rel_err(t, r) <= 2 * rel_err(p, r) + 2e-3, (name, rel_err(t, r), rel_err(p, r))


def _tiny_llama() -> torch.nn.Module:
    """torchtitan's Llama3: D = 64 (4 heads of 16), FFN 256, 2 layers, 32 tokens."""
    return tiny_llama(4, 4, 32, head_dim=16)


@pytest.mark.parametrize("tile", [0, 20])  # 0: auto (64 = dim), here one tile of 64 tokens
def test_apply_to_llama_matches_untouched_model(tile, monkeypatch) -> None:
    reference = _tiny_llama()
    model = copy.deepcopy(reference)
    apply_tiled_mlp(model, tile)
    tiles = []

    def spy(*args):
        tiles.append(args[-1])
        return tiled_swiglu(*args)

    monkeypatch.setattr(tiled_mlp, "tiled_swiglu", spy)
    tiled = tiled_mlp_class(get_family("llama3").mlp_class)
    assert all(type(b.feed_forward) is tiled for b in model.layers.values())
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(3))
    logits = {}
    for name, m in (("reference", reference), ("tiled", model)):
        out = m(tokens)
        F.cross_entropy(out.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
        logits[name] = out.detach()
    assert tiles == [tile or 64] * 2  # both layers tiled; 0 resolves to the width
    assert rel_err(logits["tiled"], logits["reference"]) < 1e-5
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert rel_err(param.grad, ref_params[name].grad) < 1e-5, name


def test_compiled_model_matches_eager_with_the_op_kept_whole() -> None:
    """The whole model compiled (each generation calls its blocks with other arguments: 0.2.2
    passes the RoPE table, 0.3.0's attention holds it): logits and every gradient as eager, and
    the MLP one opaque node each way."""
    torch._dynamo.reset()
    model = _tiny_llama()
    apply_tiled_mlp(model, 24)
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(4))
    grad = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(5))

    def run(fn):
        model.zero_grad()
        out = fn(tokens)
        out.backward(grad)
        return [out.detach()] + [p.grad.clone() for p in model.parameters()]

    graphs = {}

    def capture(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
            return make_boxed_func(gm.forward)

        return compiler

    eager = run(model)
    backend = aot_autograd(fw_compiler=capture("fw"), bw_compiler=capture("bw"))
    compiled = run(torch.compile(model, backend=backend, fullgraph=True))
    assert len(compiled) == len(eager) > 10
    for a, e in zip(compiled, eager):
        assert rel_err(a, e) < 1e-5
    # The MLP is one opaque node each way: nothing whole-sequence x F for the compiler to keep.
    assert "upipe.tiled_swiglu_fwd.default" in graphs["fw"]
    assert "upipe.tiled_swiglu_bwd.default" in graphs["bw"]
    for ops in graphs.values():
        assert not ops & {"aten.silu.default", "aten.sigmoid.default", "aten.silu_backward.default"}


def test_inductor_matches_eager() -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 16, generator=gen)
    grad = torch.randn(40, 16, generator=gen)
    weights = _weights(16, 48, torch.float32)

    def fn(x, w1, w2, w3):
        return tiled_swiglu(x, w1, w2, w3, 16) * 2

    eager = _run(fn, x, weights, grad)
    compiled = _run(torch.compile(fn, backend="inductor", fullgraph=True), x, weights, grad)
    for a, e in zip(compiled, eager):
        assert rel_err(a, e) < 1e-5


def _peak_bytes(fn) -> int:
    """Peak CPU bytes allocated above the starting point while ``fn`` runs, from the allocator's
    own running total that the profiler records with every allocation and free."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    events.sort(key=lambda e: e["ts"])
    totals = [e["args"]["Total Allocated"] for e in events]
    start = totals[0] - events[0]["args"]["Bytes"]
    return max(totals) - start


def test_tiling_bounds_peak_memory() -> None:
    tokens, dim, hidden = 4096, 64, 1024  # one tokens x F float32 tensor: 16 MiB
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(tokens, dim, generator=gen).requires_grad_()
    grad = torch.randn(tokens, dim, generator=gen)
    weights = _weights(dim, hidden, torch.float32)

    def step(fn):
        def go():
            fn(x, *weights).backward(grad)
            for t in (x, *weights):
                t.grad = None

        return go

    untiled = step(_plain)
    tiled = step(lambda *a: tiled_swiglu(*a, tile_tokens=256))
    untiled(), tiled()  # warm up lazily initialised kernels outside the measurement
    peak_untiled, peak_tiled = _peak_bytes(untiled), _peak_bytes(tiled)
    print(
        f"\npeak extra bytes, forward+backward: untiled {peak_untiled / 2**20:.1f} MiB, "
        f"tiled (256-token tiles) {peak_tiled / 2**20:.1f} MiB"
    )
    hidden_tensor = tokens * hidden * 4
    assert peak_untiled > 4 * hidden_tensor  # the plain path really holds several N x F tensors
    assert peak_tiled < 0.5 * peak_untiled


def test_rejects_bad_tile_sizes() -> None:
    weights = _weights(8, 24, torch.float32)
    with pytest.raises(ValueError, match="tile_tokens must be a positive number of tokens, got 0"):
        tiled_swiglu(torch.randn(4, 8), *weights, tile_tokens=0)
    with pytest.raises(ValueError, match=r"tile_tokens must be >= 0.*got -1.*mlp_tile_tokens"):
        apply_tiled_mlp(_tiny_llama(), -1)


class _GeluMLP(get_family("llama3").mlp_class):
    """The family's MLP with GELU in place of SiLU: its weights, another function."""

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)) * self.w3(x))


def test_rejects_non_swiglu_modules() -> None:
    model = _tiny_llama()
    model.layers["1"].feed_forward = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with pytest.raises(
        ValueError, match=r"layers\.1\.feed_forward is Sequential.*tiled_mlp = false"
    ):
        apply_tiled_mlp(model)
    assert "forward" not in vars(model.layers["0"].feed_forward)  # nothing half-applied

    model = _tiny_llama()
    model.layers["0"].feed_forward.__class__ = _GeluMLP
    with pytest.raises(ValueError, match=r"layers\.0\.feed_forward is _GeluMLP"):
        apply_tiled_mlp(model)

    with pytest.raises(ValueError, match="no `layers`"):
        apply_tiled_mlp(torch.nn.Linear(4, 4))
