"""Sequence layouts: which global token indices each context-parallel rank holds, in what order.

A CP style's ``shard_positions(seq_len, cp_rank, cp_size)`` returns one of these. Everything that
splits or reassembles a sequence (the trainer, the loss, ``evaluate``, the planner, the tests)
indexes the sequence dimension with it, and a style called with ``positions=None`` takes its RoPE
positions from it, so the layout and the attention algorithm cannot disagree.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check(seq_len: int, cp_rank: int, cp_size: int, pieces: int, layout: str) -> int:
    """Tokens per piece; ValueError naming the numbers when ``seq_len`` does not split evenly."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}) for cp_size {cp_size}, got {cp_rank}")
    if seq_len < 1 or seq_len % pieces:
        multiple = pieces
        raise ValueError(
            f"seq_len {seq_len} cannot be split into the {pieces} equal pieces of the {layout} "
            f"layout (cp degree {cp_size}); use a multiple of {multiple}, e.g. "
            f"{max(1, seq_len // multiple) * multiple}"
        )
    return seq_len // pieces


def contiguous_positions(seq_len: int, cp_rank: int, cp_size: int) -> Tensor:
    """Rank r holds ``[r*S/C, (r+1)*S/C)``: the Ulysses / UPipe layout."""
    local = _check(seq_len, cp_rank, cp_size, cp_size, "contiguous")
    return torch.arange(cp_rank * local, (cp_rank + 1) * local)
