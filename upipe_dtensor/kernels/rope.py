"""Rotary position embedding on (batch, seq, heads, head_dim) tensors, and its transpose.

Same convention as torchtitan's Llama3 (interleaved pairs rotated by complex ``freqs_cis``), but
written on real cos/sin tables so the UPipe op can rotate one stage's heads in float32 and undo
the rotation on gradients (the VJP of a rotation by theta is a rotation by -theta), a tile of
tokens at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_table(freqs_cis: Tensor, positions: Tensor) -> Tensor:
    """Rows of the complex RoPE table at ``positions`` as real (P..., head_dim/2, 2) float32.

    ``positions`` is (S,) or (B, S) global token indices; only those rows are materialised.
    """
    return torch.view_as_real(freqs_cis[positions]).float()


TILE_TOKENS = 16384
"""Tokens rotated at a time: the float32 temporaries of one tile, not of the whole shard (at 655K
tokens per GPU a stage's float32 copies would be several GiB)."""


def _rotate(x: Tensor, table: Tensor, sign: float) -> Tensor:
    # table: (S, d/2, 2) or (B, S, d/2, 2) -> broadcast over batch and heads.
    if table.dim() == 3:
        table = table.unsqueeze(0)
    out = torch.empty_like(x)
    for start in range(0, x.shape[1], TILE_TOKENS):
        rows = table[:, start : start + TILE_TOKENS]
        cos, sin = rows[..., 0].unsqueeze(2), rows[..., 1].unsqueeze(2) * sign
        pairs = x[:, start : start + TILE_TOKENS].float().unflatten(-1, (-1, 2))
        real, imag = pairs[..., 0], pairs[..., 1]
        # Written (and cast) straight into the output: no stacked float32 copy of the tile.
        rotated = out[:, start : start + TILE_TOKENS].unflatten(-1, (-1, 2))
        rotated[..., 0] = real * cos - imag * sin
        rotated[..., 1] = real * sin + imag * cos
    return out


def apply_rope(x: Tensor, table: Tensor) -> Tensor:
    """Rotate every head of ``x`` (B, S, h, d) by its position's angles."""
    return _rotate(x, table, 1.0)


def apply_rope_transpose(grad: Tensor, table: Tensor) -> Tensor:
    """Gradient of ``apply_rope`` with respect to its input: rotate back."""
    return _rotate(grad, table, -1.0)
