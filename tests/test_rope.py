"""RoPE without a position table: frequencies and angles against transformers and torchtitan
(the installed generation's Llama3 RoPE: 0.2.2's ``precompute_freqs_cis``, 0.3.0's
``ComplexRoPE``)."""

from __future__ import annotations

import pytest
import torch
from harness import rel_err
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from upipe_dtensor.kernels import rope
from upipe_dtensor.kernels.rope import complex_table_rows, rope_frequencies, rope_table
from upipe_dtensor.models import build_llama3
from upipe_dtensor.models.generation import family_module, generation_module

pytestmark = pytest.mark.unit

RoPEScalingArgs = generation_module().RoPEScalingArgs
"""Llama 3.1's scaling as the installed generation's models hold it."""

# Llama 3.1's scaling, and one with a short original context so that all three bands (kept,
# interpolated, slowed down) hold frequencies of a head_dim-32 model.
SCALINGS = {
    "llama3.1": (500000.0, RoPEScalingArgs(8.0, 1.0, 4.0, 8192)),
    "three-bands": (10000.0, RoPEScalingArgs(4.0, 1.0, 4.0, 32)),
    "none": (10000.0, RoPEScalingArgs(scaling_factor=1.0)),
}


@pytest.mark.parametrize("name", SCALINGS)
def test_frequencies_equal_transformers(name: str) -> None:
    theta, scaling = SCALINGS[name]
    head_dim = 32
    rope_parameters = {"rope_type": "default", "rope_theta": theta}
    if scaling.scaling_factor != 1:
        rope_parameters.update(
            rope_type="llama3",
            factor=scaling.scaling_factor,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings,
        )
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=2, head_dim=head_dim, rope_parameters=rope_parameters
    )
    if scaling.scaling_factor == 1:
        expected = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    ours = rope_frequencies(head_dim, theta, scaling)
    assert ours.dtype == torch.float64
    assert rel_err(ours, expected) < 1e-6
    if name == "three-bands":  # the test covers what it says: kept, interpolated, slowed down
        unscaled = rope_frequencies(head_dim, theta, RoPEScalingArgs(scaling_factor=1.0))
        ratio = unscaled / ours
        assert (ratio == 1).any() and (ratio == 4).any() and ((ratio > 1) & (ratio < 4)).any()


@pytest.mark.parametrize("batched", [False, True])
def test_angles_equal_torchtitans_table(monkeypatch, batched: bool) -> None:
    """The angles of the given positions only, tile by tile, equal torchtitan's table rows."""
    monkeypatch.setattr(rope, "TILE_TOKENS", 7)  # several tiles, the last one partial
    theta, scaling = SCALINGS["three-bands"]
    table = family_module("llama3").torchtitan_rope_table(32, 4096, theta, scaling)
    positions = torch.randint(
        0, 4096, (2, 40) if batched else (40,), generator=torch.Generator().manual_seed(0)
    )
    ours = rope_table(rope_frequencies(32, theta, scaling), positions)
    expected = complex_table_rows(table, positions)  # torchtitan's rows, as real (cos, sin)
    assert ours.shape == expected.shape == (*positions.shape, 16, 2) and ours.dtype == torch.float32
    # torchtitan's angles are float32 products: off by up to half an ulp of position * freq.
    assert (ours - expected).abs().max() < 4096 * 2**-22


def test_no_position_table_at_5m_tokens() -> None:
    """The model's RoPE is head_dim/2 frequencies, not a max_seq_len-row table: the frequencies
    its blocks read, and every buffer it holds (0.3.0 keeps one in each layer's ``rope``)."""
    with torch.device("meta"):
        model = build_llama3("8B", seq_len=5 * 2**20)
    frequencies = model.rope_frequencies()
    assert frequencies.shape == (64,) and frequencies.dtype == torch.float64
    buffers = dict(model.named_buffers())
    assert buffers and all(b.numel() <= 64 for b in buffers.values()), {
        name: tuple(b.shape) for name, b in buffers.items()
    }
