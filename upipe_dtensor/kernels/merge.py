"""Exact merge of partial attention results through their log-sum-exp (online softmax).

Attention of a query over keys split into blocks A and B is
    out = out_A * exp(lse_A - lse) + out_B * exp(lse_B - lse),   lse = logaddexp(lse_A, lse_B),
where (out_X, lse_X) is the attention over block X alone. Ring attention merges one block per ring
step and FPDT one per earlier sequence chunk; both keep the running output and LSE in float32 so
the result equals one softmax over all keys up to float32 rounding. A query that sees no key of a
block has lse = -inf there and gets weight 0 (never NaN).

The same rule holds for every sum of partial results across stages, chunks and ring steps in the
attention ops (dQ, dK, dV, dx, weight gradients): ``accumulator`` keeps it in at least float32
and the caller casts once at the end, so a bf16 sum of n pieces rounds once, not n times.
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


class PartialAttention:
    """The running (out, lse) of one block of queries, in float32 (``accumulation_dtype``)."""

    def __init__(self, out: Tensor, lse: Tensor) -> None:
        # Updated in place: a float32 block output (fresh from the kernel) is taken over, not
        # copied.
        self.out = out.to(accumulation_dtype(out.dtype))
        self.lse = lse.float().clone()  # updated in place, slice by slice

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
        """(out in ``dtype``, lse float32)."""
        return self.out.to(dtype), self.lse
