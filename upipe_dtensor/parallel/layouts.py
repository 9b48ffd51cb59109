"""Sequence layouts: which global token indices each context-parallel rank holds, in what order.

A CP style's ``shard_positions(seq_len, cp_rank, cp_size)`` returns one of these (in host memory,
or built on ``device`` where a step needs them there: no host-to-device copy). Everything that
splits or reassembles a sequence (the trainer, the loss, ``evaluate``, the planner, the tests)
indexes the sequence dimension with it, and a style called with ``positions=None`` takes its RoPE
positions from it, so the layout and the attention algorithm cannot disagree.

- contiguous (Ulysses, UPipe): rank r holds ``[r*S/C, (r+1)*S/C)``.
- ring (load-balanced "zigzag"): the sequence is cut into 2R chunks and ring rank p holds chunk p
  followed by chunk 2R-1-p, so causal work is the same on every rank. The first R chunks have
  ceil(m/2) tokens and the last R floor(m/2), m = S/R, so any S divisible by R works.
- 2D (UPipe inside a node x ring across nodes): ring rank p's tokens as above, split contiguously
  over the C/R ranks of its head group (head axis innermost): the head all-to-all gathers exactly
  the ring rank's zigzag pair, in order, which is what the ring algorithm expects.
- chunked (FPDT, its paper's Figure 6): the local sequence is u chunks; rank r's chunk i is global
  piece i*C + r, so the all-to-all of chunk i gathers one contiguous global range and causality
  holds chunk by chunk. Chunk lengths may differ by one token, so any S divisible by C works.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_rank(cp_rank: int, cp_size: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}) for cp_size {cp_size}, got {cp_rank}")


def _check_divisible(seq_len: int, parts: int, layout: str) -> int:
    if seq_len < parts or seq_len % parts:
        raise ValueError(
            f"seq_len {seq_len} cannot be split evenly over the {parts} ranks of the {layout} "
            f"layout; use a multiple of {parts}, e.g. {max(1, seq_len // parts) * parts}"
        )
    return seq_len // parts


def split_lengths(total: int, parts: int) -> list[int]:
    """``total`` tokens in ``parts`` near-equal pieces, the longer ones first."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def contiguous_positions(seq_len: int, cp_rank: int, cp_size: int, device=None) -> Tensor:
    """Rank r holds ``[r*S/C, (r+1)*S/C)``: the Ulysses / UPipe layout."""
    _check_rank(cp_rank, cp_size)
    local = _check_divisible(seq_len, cp_size, "contiguous")
    return torch.arange(cp_rank * local, (cp_rank + 1) * local, device=device)


def ring_halves(seq_len: int, ring_size: int) -> tuple[int, int]:
    """Tokens of a ring rank's early and late chunk: (ceil(m/2), floor(m/2)), m = S/R."""
    first, second = split_lengths(_check_divisible(seq_len, ring_size, "ring"), 2)
    return first, second


def ring_positions(seq_len: int, ring_rank: int, ring_size: int, device=None) -> Tensor:
    """Ring rank p's tokens in order: chunk p, then chunk 2R-1-p (the zigzag pairing)."""
    _check_rank(ring_rank, ring_size)
    first, second = ring_halves(seq_len, ring_size)
    early = ring_rank * first
    late = ring_size * first + (ring_size - 1 - ring_rank) * second
    return torch.cat(
        [
            torch.arange(early, early + first, device=device),
            torch.arange(late, late + second, device=device),
        ]
    )


def two_d_positions(
    seq_len: int, cp_rank: int, cp_size: int, ring_size: int, device=None
) -> Tensor:
    """Rank ``cp_rank = ring_rank * (C/R) + head_rank``: its contiguous slice of the ring rank's
    zigzag tokens. ``ring_size = C`` is pure ring attention, ``ring_size = 1`` contiguous."""
    _check_rank(cp_rank, cp_size)
    if ring_size < 1 or cp_size % ring_size:
        raise ValueError(f"ring degree {ring_size} must divide the cp degree {cp_size}")
    heads = cp_size // ring_size
    _check_divisible(seq_len, cp_size, f"{ring_size} x {heads} (ring x heads)")
    ring_rank, head_rank = divmod(cp_rank, heads)
    tokens = ring_positions(seq_len, ring_rank, ring_size, device)
    local = seq_len // cp_size
    return tokens[head_rank * local : (head_rank + 1) * local]


def chunk_count(seq_len: int, cp_size: int, chunk_tokens: int) -> int:
    """FPDT chunks per rank for global chunks of at most ``chunk_tokens`` tokens."""
    local = _check_divisible(seq_len, cp_size, "chunked")
    if chunk_tokens < cp_size:
        raise ValueError(
            f"chunk_tokens {chunk_tokens} is smaller than the cp degree {cp_size}: every global "
            f"chunk needs at least one token per rank; use chunk_tokens >= {cp_size}"
        )
    return min(local, -(-seq_len // chunk_tokens))


def chunked_positions(seq_len: int, cp_rank: int, cp_size: int, chunks: int, device=None) -> Tensor:
    """Rank r's local chunk i is global piece i*C + r (pieces of chunk i have equal length)."""
    _check_rank(cp_rank, cp_size)
    local = _check_divisible(seq_len, cp_size, "chunked")
    if not 1 <= chunks <= local:
        raise ValueError(f"{chunks} chunks per rank do not fit {local} local tokens")
    pieces, start = [], 0
    for length in split_lengths(local, chunks):
        first = start + cp_rank * length
        pieces.append(torch.arange(first, first + length, device=device))
        start += cp_size * length
    return torch.cat(pieces)
