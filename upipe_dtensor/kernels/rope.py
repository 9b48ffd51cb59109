"""Rotary position embedding on (batch, seq, heads, head_dim) tensors, and its transpose.

Two conventions of which elements of a head form a rotated pair, named by ``RopePairs``:
torchtitan's Llama3 rotates interleaved pairs (2i, 2i+1) (complex ``freqs_cis``), Qwen3 and
Hugging Face's ``rotate_half`` rotate the halves' pairs (i, i + d/2). Both rotate pair i by the
same angle, so one real cos/sin table serves both. Written on real tables so the UPipe op can
rotate one stage's heads in float32 and undo the rotation on gradients (the VJP of a rotation by
theta is a rotation by -theta), in place and a tile of tokens at a time.

Our models keep no position table: their RoPE holds the head_dim/2 inverse frequencies in float64
(:func:`rope_frequencies`), and :func:`rope_table` computes the angles of the local shard's
positions only. torchtitan's table is (max_seq_len, head_dim/2) complex64,
2.5 GiB per GPU at 5M tokens for head_dim 128, and its angles are float32 products: at position
5M a float32 angle is off by up to 0.25 rad. Here the product and cos/sin run in float64 and
only the result is cast to float32.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

import torch
from torch import Tensor

from upipe_dtensor.kernels.fused import fused
from upipe_dtensor.kernels.tiling import tile_starts

RopePairs = Literal["interleaved", "half"]
"""Which elements of a head are rotated together: (2i, 2i+1) (Llama3) or (i, i + d/2) (Qwen3)."""

TILE_TOKENS = 16384
"""Tokens rotated (or given angles) at a time: the float32/float64 temporaries of one tile, not of
the whole shard (at 655K tokens per GPU a stage's float32 copies would be several GiB)."""


class RoPEScaling(Protocol):
    """Llama3's frequency scaling, as the model families' args hold it (torchtitan 0.2.2's
    ``RoPEScalingArgs``; on 0.3.0, which folds it into each RoPE module's config, the families'
    own, ``models.tt030.args``)."""

    scaling_factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def rope_frequencies(head_dim: int, theta: float, scaling: RoPEScaling) -> Tensor:
    """The (head_dim/2,) float64 inverse frequencies ``theta ** (-2i / head_dim)`` with Llama3's
    frequency-dependent scaling (``scaling_factor = 1`` leaves them unchanged).

    torchtitan's ``precompute_freqs_cis`` applies the same rule, but in float32 and only while
    building the whole position table, so it cannot give us the frequencies alone.
    """
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    factor = scaling.scaling_factor
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    original = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / freqs
    # Long wavelengths (beyond original / low) are slowed down by the factor, short ones (below
    # original / high) kept, and the band in between interpolated linearly in 1 / wavelength.
    scaled = torch.where(wavelength > original / low, freqs / factor, freqs)
    smooth = (original / wavelength - low) / (high - low)
    between = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rope_table(frequencies: Tensor, positions: Tensor) -> Tensor:
    """RoPE angles at ``positions`` as a real (P..., head_dim/2, 2) float32 table of (cos, sin).

    ``positions`` is (S,) or (B, S) global token indices (or per-document positions);
    ``frequencies`` our float64 inverse frequencies (:func:`rope_frequencies`). The angles are
    computed for these positions only, in float64, a tile at a time.
    """
    table = torch.empty(
        *positions.shape, frequencies.shape[0], 2, dtype=torch.float32, device=positions.device
    )
    for start in tile_starts(table, positions.shape[-1], TILE_TOKENS):
        tile = slice(start, start + TILE_TOKENS)
        angles = positions[..., tile, None].to(torch.float64) * frequencies
        table[..., tile, :, 0] = angles.cos()
        table[..., tile, :, 1] = angles.sin()
    return table


def complex_table_rows(table: Tensor, positions: Tensor) -> Tensor:
    """``rope_table``'s form of the rows at ``positions`` of a complex (max_seq_len, head_dim/2)
    position table (torchtitan's Llama3 ``freqs_cis``)."""
    return torch.view_as_real(table[positions]).float()


def cos_sin_table_rows(table: Tensor, positions: Tensor) -> Tensor:
    """``rope_table``'s form of the rows at ``positions`` of a real (max_seq_len, 2 * head_dim)
    table of [cos, cos, sin, sin] of the angles (torchtitan's Qwen3 ``rope_cache``: each half
    repeats the head_dim/2 angles)."""
    half = table.shape[1] // 4
    rows = table[positions]
    return torch.stack((rows[..., :half], rows[..., 2 * half : 3 * half]), dim=-1).float()


ROTATION_TILES = 8
"""A rotation runs in at least this many tiles (of at most ``TILE_TOKENS``): its float32
temporaries are an eighth of the tensor at any length, not all of it on a short shard."""


def _rotate_(x: Tensor, table: Tensor, sign: float, pairs: RopePairs) -> Tensor:
    # table: (S, d/2, 2) or (B, S, d/2, 2) -> broadcast over batch and heads.
    if table.dim() == 3:
        table = table.unsqueeze(0)
    tokens = x.shape[1]
    size = max(1, min(TILE_TOKENS, -(-tokens // ROTATION_TILES)))
    for start in tile_starts(x, tokens, size):
        tile = slice(start, start + size)
        _rotate_into(x[:, tile], table[:, tile], sign, pairs == "half")
    return x


@fused
def _rotate_into(x: Tensor, rows: Tensor, sign: float, halves: bool) -> None:
    """One tile of ``x``, in place: each pair rotated by its row's (cos, sign * sin); the pairs
    are (i, i + d/2) with ``halves``, else (2i, 2i+1). Both halves of the result are computed
    (real * cos - imag * sin and real * sin + imag * cos, in float32) before either is written
    back and cast."""
    cos, sin = rows[..., 0].unsqueeze(2), rows[..., 1].unsqueeze(2) * sign
    shape, member = ((2, -1), -2) if halves else ((-1, 2), -1)
    pairs = x.float().unflatten(-1, shape)
    real, imag = pairs.select(member, 0), pairs.select(member, 1)
    first = real * cos
    first.sub_(imag * sin)
    second = real * sin
    second.add_(imag * cos)
    rotated = x.unflatten(-1, shape)
    rotated.select(member, 0).copy_(first)
    rotated.select(member, 1).copy_(second)


def apply_rope_(x: Tensor, table: Tensor, pairs: RopePairs = "interleaved") -> Tensor:
    """Rotate every head of ``x`` (B, S, h, d) by its position's angles, in place (the attention
    ops rotate tensors they own: a fresh projection, an arriving gradient); returns ``x``."""
    return _rotate_(x, table, 1.0, pairs)


def apply_rope_transpose_(grad: Tensor, table: Tensor, pairs: RopePairs = "interleaved") -> Tensor:
    """Gradient of ``apply_rope_`` with respect to its input, in place: rotate back."""
    return _rotate_(grad, table, -1.0, pairs)
