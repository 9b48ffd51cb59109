"""Exact merge of partial attention results through their log-sum-exp (online softmax).

Attention of a query over keys split into blocks A and B is
    out = out_A * exp(lse_A - lse) + out_B * exp(lse_B - lse),   lse = logaddexp(lse_A, lse_B),
where (out_X, lse_X) is the attention over block X alone. Ring attention merges one block per ring
step and FPDT one per earlier sequence chunk; both keep the running output and LSE in float32 so
the result equals one softmax over all keys up to float32 rounding. A query that sees no key of a
block has lse = -inf there and gets weight 0 (never NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor


class PartialAttention:
    """The running (out, lse) of one block of queries, in float32."""

    def __init__(self, out: Tensor, lse: Tensor) -> None:
        # Updated in place: a float32 block output (fresh from the kernel) is taken over, not
        # copied.
        self.out = out.float()
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
        self.out[:, rows].mul_(old).add_(out.float() * new)
        self.lse[:, :, rows] = merged

    def result(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(out in ``dtype``, lse float32)."""
        return self.out.to(dtype), self.lse
