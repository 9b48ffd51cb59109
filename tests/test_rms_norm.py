"""Tiled RMSNorm equals torch.rms_norm (outputs and gradients), compiles as one node, and keeps
no full-size float32 intermediates."""

from __future__ import annotations

import pytest
import torch
from harness import rel_err

from upipe_dtensor.memory.rms_norm import apply_tiled_rms_norm, tiled_rms_norm
from upipe_dtensor.modes.ops import transparent_ops
from upipe_dtensor.planning.tracker import LiveMemoryTracker

pytestmark = pytest.mark.unit


def _both(x: torch.Tensor, weight: torch.Tensor, tile: int, grad: torch.Tensor):
    results = []
    for fn in (
        lambda a, w: tiled_rms_norm(a, w, 1e-5, tile),
        lambda a, w: torch.rms_norm(a, [a.shape[-1]], w, 1e-5),
    ):
        a, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(a, w)
        out.backward(grad)
        results.append((out.detach(), a.grad, w.grad))
    return results


@pytest.mark.parametrize(
    "shape,tile", [((2, 37, 64), 10), ((1, 5, 32), 100), ((3, 64, 128), 64), ((40, 16), 1)]
)
def test_float32_equals_torch(shape: tuple, tile: int) -> None:
    torch.manual_seed(0)
    x, weight, grad = torch.randn(shape), torch.randn(shape[-1]) * 0.1 + 1, torch.randn(shape)
    tiled, plain = _both(x, weight, tile, grad)
    for a, b in zip(tiled, plain):
        assert rel_err(a, b) < 1e-6


def test_bfloat16_as_accurate_as_torch() -> None:
    torch.manual_seed(0)
    shape = (2, 300, 256)
    x = torch.randn(shape, dtype=torch.bfloat16)
    weight = (torch.randn(256) * 0.1 + 1).to(torch.bfloat16)
    grad = torch.randn(shape, dtype=torch.bfloat16)
    tiled, plain = _both(x, weight, 64, grad)
    truth = _both(x.double(), weight.double(), 300 * 2, grad.double())[1]
    for t, p, exact in zip(tiled, plain, truth):
        assert rel_err(t, exact) <= rel_err(p, exact) * 1.05 + 1e-6


def test_compiles_as_one_opaque_node() -> None:
    norm = torch.nn.RMSNorm(64, eps=1e-5)
    apply_tiled_rms_norm(torch.nn.ModuleDict({"n": norm}), tile_tokens=7)
    x = torch.randn(3, 20, 64, requires_grad=True)
    compiled = torch.compile(norm, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    expected = torch.rms_norm(x.detach(), [64], norm.weight.detach(), 1e-5)
    assert rel_err(out, expected) < 1e-6


def test_no_full_size_float32_intermediates() -> None:
    x = torch.randn(8192, 256, dtype=torch.bfloat16, requires_grad=True)  # 4 MiB in bf16
    weight = torch.ones(256, dtype=torch.bfloat16, requires_grad=True)
    peaks = {}
    for name, fn in (
        ("tiled", lambda: tiled_rms_norm(x, weight, 1e-5, 256)),
        ("plain", lambda: torch.rms_norm(x, [256], weight, 1e-5)),
    ):
        tracker = LiveMemoryTracker()
        with transparent_ops(), tracker:
            tracker.start_step()
            fn().backward(torch.ones_like(x))
        peaks[name] = tracker.peaks["cpu"].bytes
        x.grad = weight.grad = None
    # Plain keeps float32 copies of x (8 MiB each); tiled: output, dx, grad and one tile.
    assert peaks["tiled"] < 0.6 * peaks["plain"], peaks


def test_bad_tile() -> None:
    with pytest.raises(ValueError, match="norm_tile_tokens = -1"):
        apply_tiled_rms_norm(torch.nn.RMSNorm(8), -1)
