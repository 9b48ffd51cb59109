"""Exact merge of partial attention results through their log-sum-exp (online softmax).

Attention of a query over keys split into blocks A and B is
    out = out_A * exp(lse_A - lse) + out_B * exp(lse_B - lse),   lse = logaddexp(lse_A, lse_B),
where (out_X, lse_X) is the attention over block X alone. Ring attention merges one block per ring
step and FPDT one per earlier sequence chunk; both keep the running output and LSE in float32 so
the result equals one softmax over all keys up to float32 rounding. A query that sees no key of a
block has lse = -inf there and gets weight 0 (never NaN).

The same rule holds for the sums of partial results across ring steps, sequence chunks and a KV
block's head stages in the attention ops (dQ, dK, dV, weight gradients): ``accumulator`` and
``add_piece`` keep them in at least float32 and the caller casts once at the end, so a bf16 sum of
n pieces rounds once, not n times. A layer's dx is not such a running sum: it is formed from a few
products through wq, wk and wv once their gradients are final (``parallel.staged_attention``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are summed in: at least float32 (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def accumulator(like: Tensor, *, summed: bool = True) -> Tensor:
    """Zeros shaped like ``like`` to add pieces into: in ``accumulation_dtype`` when more than one
    piece is added (``summed``), else in ``like``'s dtype (nothing to round, no extra memory)."""
    dtype = accumulation_dtype(like.dtype) if summed else like.dtype
    return torch.zeros_like(like, dtype=dtype)


def add_piece(total: Tensor | None, piece: Tensor, pieces: int) -> Tensor:
    """``total + piece``, in place, for a sum of ``pieces`` pieces that ``total`` (None before the
    first) accumulates. The first piece starts the sum: taken over as it is when it is the only
    one or already in ``accumulation_dtype`` (a ring's float32 sum), so no zeros are added and
    nothing is copied; else as a float32 copy. The caller owns every piece it passes."""
    if total is not None:
        return total.add_(piece)
    dtype = accumulation_dtype(piece.dtype)
    return piece if pieces == 1 or piece.dtype == dtype else piece.to(dtype)


class PartialAttention:
    """The running (out, lse) of one block of queries, in float32 (``accumulation_dtype``)."""

    def __init__(self, out: Tensor, lse: Tensor) -> None:
        # Updated in place: a float32 block output (fresh from the kernel) is taken over, not
        # copied.
        self.out = out.to(accumulation_dtype(out.dtype))
        self.lse = lse.to(self.out.dtype, copy=True)  # updated in place, slice by slice

    def add(self, out: Tensor, lse: Tensor, start: int = 0) -> None:
        """Fold in the attention of queries ``start:start + len`` over another block of keys."""
        rows = slice(start, start + out.shape[1])
        running = self.lse[:, :, rows]
        merged = torch.logaddexp(running, lse)
        finite = merged > -torch.inf
        # (B, h, S) weights -> (B, S, h, 1) to scale (B, S, h, d) outputs.
        old = torch.where(finite, torch.exp(running - merged), 0.0).transpose(1, 2).unsqueeze(-1)
        new = torch.where(finite, torch.exp(lse - merged), 0.0).transpose(1, 2).unsqueeze(-1)
        self.out[:, rows].mul_(old).add_(out * new)
        self.lse[:, :, rows] = merged

    def result(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(out in ``dtype``, lse in the accumulation dtype: float32, float64 for float64)."""
        return self.out.to(dtype), self.lse
