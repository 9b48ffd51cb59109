"""The elementwise parts of a SwiGLU tile's forward and backward, fused into one kernel each
when a backend is set (``kernels.fused``): shared by the dense tiled MLP (``tiled_mlp``) and the
experts' (``grouped_swiglu``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from upipe_dtensor.kernels.fused import fused


@fused
def silu_times_(a: Tensor, b: Tensor) -> None:
    """``a`` <- silu(a) * b, in place: the tile's hidden state."""
    F.silu(a, inplace=True).mul_(b)


@fused
def silu_times(a: Tensor, b: Tensor) -> Tensor:
    """silu(a) * b, a new tensor (``a`` is still needed)."""
    return F.silu(a) * b


@fused
def grad_of_product_(grad_h: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """From the hidden state's gradient: returns d loss / d b = grad_h * silu(a), and turns
    ``grad_h`` into d loss / d silu(a) = grad_h * b in place."""
    grad_b = grad_h * F.silu(a)
    grad_h.mul_(b)
    return grad_b


@fused
def grad_of_silu_(a: Tensor, grad_silu: Tensor) -> None:
    """``a`` <- d loss / d a = grad_silu * silu'(a), in place, where
    silu'(a) = sigmoid(a) * (1 + a * (1 - sigmoid(a)))."""
    sig = torch.sigmoid(a)
    a.mul_(1 - sig).add_(1).mul_(sig).mul_(grad_silu)
