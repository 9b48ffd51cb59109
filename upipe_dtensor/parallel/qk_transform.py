"""The per-head function a model family applies to Q and K before RoPE, and its backward.

Qwen3 normalises each query and key head (RMSNorm over head_dim with a learned weight, QK-norm)
before rotating it; Llama3 applies nothing. A family names its function in ``QK_TRANSFORMS`` and
writes only its forward: ``QKTransform.backward`` differentiates it with autograd on one
stage's (or one KV block's) heads, recomputed from x there, so the fused attention ops keep
their memory behaviour (nothing of the transform is saved between forward and backward) and no
family hand-writes a vector-Jacobian product. The weights' gradients are summed over the stages,
KV blocks and chunks in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from upipe_dtensor.kernels.merge import accumulator
from upipe_dtensor.parallel.attention_op import AttentionParams, AttentionWeights


def _rms_norm(heads: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of each head over head_dim, as torch's ``nn.RMSNorm(head_dim)`` computes it."""
    return F.rms_norm(heads, (heads.shape[-1],), weight, eps)


QK_TRANSFORMS: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {"rms_norm": _rms_norm}
"""name -> forward(heads (B, L, h, d), weight, eps) -> heads, of the families' per-head
functions of Q and K before RoPE (``AttentionParams.qk_transform``)."""

Which = Literal["q", "k"]


class QKTransform:
    """One layer call's per-head transform of Q and K (identity when the family has none), and
    the float32 sums of its weights' gradients."""

    def __init__(self, weights: AttentionWeights, params: AttentionParams) -> None:
        self.function = QK_TRANSFORMS[params.qk_transform] if params.qk_transform else None
        if self.function is not None and (weights.q_norm is None or weights.k_norm is None):
            raise ValueError(
                f"qk_transform = {params.qk_transform!r} needs the q_norm and k_norm weights"
            )
        self.eps = params.qk_eps
        self.weights = {"q": weights.q_norm, "k": weights.k_norm}
        self.grads: dict[Which, Tensor | None] = {
            which: accumulator(w, summed=True) if w is not None and params.needs(name) else None
            for (which, w), name in zip(self.weights.items(), ("q_norm", "k_norm"))
        }

    def forward(self, heads: Tensor, which: Which) -> Tensor:
        if self.function is None:
            return heads
        return self.function(heads, self.weights[which], self.eps)

    def backward(self, project: Callable[[], Tensor], grad: Tensor, which: Which) -> Tensor:
        """The gradient before the transform from ``grad`` after it; ``project()`` recomputes
        its input (x @ rows.T). Adds the weight's gradient to its float32 sum when autograd asks
        for it (``AttentionParams.needs``)."""
        if self.function is None:
            return grad
        # torch.func's transform, not torch.autograd: an op body runs below the autograd key,
        # where tensors record no graph whatever the grad mode says.
        _, vjp = torch.func.vjp(
            lambda heads, weight: self.function(heads, weight, self.eps),
            project(),
            self.weights[which],
        )
        grad_heads, grad_weight = vjp(grad)
        if self.grads[which] is not None:  # None: the weight is frozen
            self.grads[which].add_(grad_weight)
        return grad_heads

    def weight_grads(self) -> tuple[Tensor | None, Tensor | None]:
        """The gradients of q_norm and k_norm in their own dtype (None without a transform, or
        for a frozen weight)."""
        return tuple(
            None if g is None else g.to(self.weights[w].dtype) for w, g in self.grads.items()
        )
