"""Chunked (fused) output projection + cross-entropy: the loss without the full logits.

At 655K tokens per GPU and a 128K vocabulary, ``(h @ weight.T).float()`` alone is ~320 GiB, and
autograd keeps it (plus its gradient) until the backward. Here the projection and the loss run over
``chunk_tokens`` tokens at a time, and each chunk's gradients are computed right away:

    logits_c      = (h_c @ weight.T).float()                     (c, V) float32
    loss         += sum over kept tokens of logsumexp(logits_c) - logits_c[label]
    grad_logits_c = softmax(logits_c) - onehot(label)            zero rows for ignored labels
    grad_h_c      = grad_logits_c.to(h.dtype) @ weight
    grad_weight  += grad_logits_c.to(h.dtype).T @ h_c           float32 accumulator

Why gradients in the forward: the loss is the last op of the step, so its backward follows at once
with a scalar incoming gradient. Computing d(loss)/dh and d(loss)/dweight while each chunk's logits
exist, and only scaling them by that scalar in the backward, avoids keeping or recomputing any
logits. The backward is two multiplications.

Why the gradient is cast to ``h.dtype`` before the matmuls: the plain path's ``.float()`` casts the
float32 logit gradient back to ``h.dtype`` in its backward and multiplies in that dtype, so this is
the same computation (identical per-token ``grad_h``); in float32 the cast is a no-op.
``grad_weight`` differs only in summation order: each chunk's ``h.dtype`` product is added into a
float32 accumulator and rounded to ``weight.dtype`` once, where the plain path does one matmul over
all tokens.

Memory bound (N tokens, c = chunk_tokens, V vocabulary, D model dim, b bytes per element of h):
  alive across the loop : grad_h (N*D*b, the size of h) + the float32 grad_weight accumulator
                          (V*D*4) + the float32 loss scalar.
  alive for one chunk   : its logits in h.dtype (c*V*b, cast away at once), float32 (c*V*4, turned
                          into the gradient in place), the gradient in h.dtype (c*V*b) and the
                          chunk's h.dtype grad_weight term (V*D*b) before it is added.
  saved for backward    : grad_h and grad_weight in their parameters' dtypes (no logits).
Nothing scales with N*V: with c*V << N*D the loss costs about as much memory as one more copy of h.
"""

from __future__ import annotations

import torch
from torch import Tensor

from upipe_dtensor.kernels.op_mode import OpSpec, call
from upipe_dtensor.kernels.tiling import tile_starts


def _loss_and_grads(
    h: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The chunk loop: (float32 loss sum, d loss / d h, d loss / d weight)."""
    h_flat = h.reshape(-1, h.shape[-1])
    labels_flat = labels.reshape(-1)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h_flat)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for start in tile_starts(h_flat, h_flat.shape[0], chunk_tokens):
        h_c = h_flat[start : start + chunk_tokens]
        label = labels_flat[start : start + chunk_tokens]
        keep = label != ignore_index
        target = torch.where(keep, label, 0).unsqueeze(1)

        grad = (h_c @ weight.t()).float()  # the chunk's logits, turned into their gradient in place
        lse = torch.logsumexp(grad, dim=1, keepdim=True)
        loss += torch.where(keep, (lse - grad.gather(1, target)).squeeze(1), 0.0).sum()
        grad.sub_(lse).exp_()  # softmax
        grad.scatter_(1, target, grad.gather(1, target) - 1.0)
        grad.masked_fill_(~keep.unsqueeze(1), 0.0)

        grad = grad.to(h.dtype)
        torch.mm(grad, weight, out=grad_h[start : start + chunk_tokens])
        grad_weight += grad.t() @ h_c
    return loss, grad_h.view_as(h), grad_weight.to(weight.dtype)


# --- registration: one opaque op, so torch.compile sees a single node for the whole loss --------


@torch.library.custom_op("upipe::chunked_ce_fwd", mutates_args=())
def _chunked_ce_fwd(
    h: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor]:
    return _loss_and_grads(h, weight, labels, chunk_tokens, ignore_index)


@_chunked_ce_fwd.register_fake
def _(h, weight, labels, chunk_tokens, ignore_index):
    return (
        h.new_empty((), dtype=torch.float32),
        h.new_empty(h.shape),
        weight.new_empty(weight.shape),
    )


def _setup_context(ctx, inputs, output) -> None:
    _, grad_h, grad_weight = output
    ctx.save_for_backward(grad_h, grad_weight)


def _backward(ctx, grad_loss: Tensor, _grad_h: Tensor | None, _grad_weight: Tensor | None):
    """Chain rule only: the gradients were computed in the forward for a unit incoming gradient."""
    grad_h, grad_weight = ctx.saved_tensors
    return grad_h * grad_loss, grad_weight * grad_loss, None, None, None


_chunked_ce_fwd.register_autograd(_backward, setup_context=_setup_context)
_FORWARD = OpSpec(_chunked_ce_fwd, _loss_and_grads, _setup_context, _backward)


def chunked_cross_entropy_sum(
    h: Tensor, weight: Tensor, labels: Tensor, *, chunk_tokens: int, ignore_index: int = -100
) -> Tensor:
    """Sum of per-token cross-entropy of ``h @ weight.T`` over non-ignored labels, chunk by chunk.

    ``h`` (..., D) final-norm hidden states, ``weight`` (V, D) the output projection, ``labels``
    (...) int64 with ``h``'s leading dims. Returns the float32 scalar that
    ``F.cross_entropy((h @ weight.T).float().flatten(0, -2), labels.flatten(), reduction="sum")``
    gives, differentiable w.r.t. ``h`` and ``weight``; see the module docstring for memory.
    """
    if chunk_tokens < 1:
        raise ValueError(
            f"chunk_tokens must be >= 1, got {chunk_tokens}; pass a positive number of tokens "
            "per chunk (a few thousand bounds the logits to chunk_tokens x vocab floats)"
        )
    if labels.shape != h.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal h's leading dims {tuple(h.shape[:-1])}"
        )
    loss, _, _ = call(_FORWARD, h, weight, labels, chunk_tokens, ignore_index)
    return loss
