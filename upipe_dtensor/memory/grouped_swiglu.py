"""A mixture of experts' grouped SwiGLU that keeps only its input for backward.

The routed tokens arrive sorted by expert (torchtitan's token dispatcher): R = tokens x top-k
rows of width D, ``offsets`` the end row of each expert's group. Plain autograd keeps four R x F
hidden tensors per block for backward; at long context R is top-k times the sequence, so they
are the MoE block's largest activations. Here backward recomputes them from the saved input
(one more forward of the experts' matmuls), as the dense tiled MLP does per tile; the MoE
block's tokens are tiled one level up (``memory.tiled_moe``), so R is one tile's rows there.

The pair is a ``torch.library.custom_op`` per direction, so ``torch.compile`` sees one opaque
node each and cannot keep the hidden states.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from upipe_dtensor.kernels.op_mode import OpSpec, call
from upipe_dtensor.memory import swiglu_parts
from upipe_dtensor.runtime import torch_private
from upipe_dtensor.runtime.torch_private import is_fake

# The elementwise parts unfused: how many rows an expert-parallel rank receives changes with the
# routing at every step and block, and the fused kernels are compiled for static shapes
# (``kernels.fused``), so each new count would compile again.
silu_times_, silu_times, grad_of_product_, grad_of_silu_ = (
    part.__wrapped__
    for part in (
        swiglu_parts.silu_times_,
        swiglu_parts.silu_times,
        swiglu_parts.grad_of_product_,
        swiglu_parts.grad_of_silu_,
    )
)


def grouped_mm(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """``torch._grouped_mm(a, b, offs=offsets)``: a (R, K) x b (E, K, N) -> (R, N), each row's
    expert by the offsets; or a (M, R) x b (R, N) -> (E, M, N), each expert's rows summed.

    torch's meta function for it accepts bf16 only (the CUDA kernel's rule) while its CPU
    implementation computes in float32 too; on fake float32 tensors (the planner's CPU plans)
    this allocates the output the CPU kernel returns."""
    if a.dtype != torch.bfloat16 and is_fake(a):
        if b.dim() == 3:
            return a.new_empty(a.shape[0], b.shape[-1])
        return a.new_empty(offsets.shape[0], a.shape[0], b.shape[-1])
    return torch_private.grouped_mm(a, b, offs=offsets)


def grouped_swiglu_forward(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, offsets: Tensor):
    """``w2_e(silu(w1_e x) * w3_e x)`` for the routed rows ``x`` (R, D); ``w1``, ``w3`` are
    (E, F, D), ``w2`` (E, D, F), as torchtitan's ``GroupedExperts`` holds them."""
    h = grouped_mm(x, w1.transpose(-2, -1), offsets)
    silu_times_(h, grouped_mm(x, w3.transpose(-2, -1), offsets))
    return grouped_mm(h, w2.transpose(-2, -1), offsets)


def grouped_swiglu_backward(
    grad_out: Tensor, x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, offsets: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Recompute the hidden state and backpropagate it; returns (dx, dw1, dw2, dw3), each
    weight's gradient one grouped GEMM over its expert's rows (accumulated in float32 inside)."""
    a = grouped_mm(x, w1.transpose(-2, -1), offsets)
    b = grouped_mm(x, w3.transpose(-2, -1), offsets)
    grad_w2 = grouped_mm(grad_out.t(), silu_times(a, b), offsets)
    grad_h = grouped_mm(grad_out, w2, offsets)
    grad_b = grad_of_product_(grad_h, a, b)
    del b
    grad_of_silu_(a, grad_h)
    grad_a = a
    del a, grad_h
    grad_x = grouped_mm(grad_a, w1, offsets)
    grad_x += grouped_mm(grad_b, w3, offsets)
    grad_w1 = grouped_mm(grad_a.t(), x, offsets)
    grad_w3 = grouped_mm(grad_b.t(), x, offsets)
    return grad_x, grad_w1, grad_w2, grad_w3


# --- registration: one opaque op per direction -------------------------------------------------


@torch.library.custom_op("upipe::grouped_swiglu_fwd", mutates_args=())
def _fwd(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, offsets: Tensor) -> Tensor:
    return grouped_swiglu_forward(x, w1, w2, w3, offsets)


@_fwd.register_fake
def _(x, w1, w2, w3, offsets):
    return x.new_empty(x.shape[0], w2.shape[1])


@torch.library.custom_op("upipe::grouped_swiglu_bwd", mutates_args=())
def _bwd(
    grad_out: Tensor, x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, offsets: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return grouped_swiglu_backward(grad_out, x, w1, w2, w3, offsets)


@_bwd.register_fake
def _(grad_out, x, w1, w2, w3, offsets):
    return tuple(t.new_empty(t.shape) for t in (x, w1, w2, w3))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_out: Tensor):
    return (*call(_BACKWARD, grad_out, *ctx.saved_tensors), None)


_fwd.register_autograd(_backward, setup_context=_setup_context)
_FORWARD = OpSpec(_fwd, grouped_swiglu_forward, _setup_context, _backward)
_BACKWARD = OpSpec(_bwd, grouped_swiglu_backward)


def grouped_swiglu(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, offsets: Tensor) -> Tensor:
    """Differentiable grouped ``w2_e(silu(w1_e x) * w3_e x)`` for routed rows ``x`` (R, D)
    sorted by expert, ``offsets`` (E,) the end row of each expert's group. Only ``x`` is saved
    for backward."""
    return call(_FORWARD, x, w1, w2, w3, offsets)


class GroupedSwiGLUForward:
    """The forward of torchtitan's ``GroupedExperts`` (``w1_EFD``, ``w2_EDF``, ``w3_EFD``)
    computed by ``grouped_swiglu`` in the routed tokens' dtype, mixed into a family's experts
    class before torchtitan's. Weights are read per call (FSDP2's unsharded ones)."""

    def forward(self, x_RD: Tensor, num_tokens_per_expert_E: Tensor) -> Tensor:
        w1, w2, w3 = (
            (w.to_local() if isinstance(w, DTensor) else w).to(x_RD.dtype)
            for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        )
        offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        return grouped_swiglu(x_RD, w1, w2, w3, offsets)
