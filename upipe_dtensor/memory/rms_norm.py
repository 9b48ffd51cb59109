"""Sequence-tiled RMSNorm: the norm without full-size float32 intermediates.

``torch.rms_norm`` on bf16 activations upcasts to float32 and autograd keeps float32 tensors of
the input's size (the upcast input, ``x * rstd``) plus more in backward; at 655K tokens per GPU
and dim 4096 each is 10 GiB, and a block has two norms. Here the norm runs over tiles of tokens:

    rstd = rsqrt(mean(x.float()**2) + eps)          (N, 1) float32, saved
    y    = x.float() * rstd * weight.float()         cast once, written tile by tile into one output

Saved for backward: x (the block's own tensor, alive anyway) and rstd (4 bytes per token). Float32
temporaries exist for one tile at a time, in forward and backward. All arithmetic is float32 with
one rounding to the activation dtype at the end, as in ``torch.rms_norm``'s fused kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from upipe_dtensor.kernels.fused import fused
from upipe_dtensor.kernels.op_mode import OpSpec, call
from upipe_dtensor.kernels.tiling import tile_starts
from upipe_dtensor.runtime.sharded_compute import local_shard_op


def rms_norm_forward(
    x: Tensor, weight: Tensor, eps: float, tile_tokens: int
) -> tuple[Tensor, Tensor]:
    """(y, rstd): the normalised ``x`` (same shape and dtype) and its float32 (N, 1) rstd."""
    flat = x.reshape(-1, x.shape[-1])
    out = x.new_empty(x.shape)  # not a view: a compiled block's output may be this buffer
    out_flat = out.view(flat.shape)
    rstd = torch.empty(flat.shape[0], 1, dtype=torch.float32, device=x.device)
    for start in tile_starts(flat, flat.shape[0], tile_tokens):
        rows = slice(start, start + tile_tokens)
        _normalize_into(out_flat[rows], rstd[rows], flat[rows], weight, eps)
    return out, rstd


@fused
def _normalize_into(out: Tensor, rstd: Tensor, x: Tensor, weight: Tensor, eps: float) -> None:
    """One tile: ``rstd`` <- 1 / rms(x), ``out`` <- x * rstd * weight (float32, one rounding)."""
    tile = x.float()
    torch.rsqrt(tile.pow(2).mean(-1, keepdim=True) + eps, out=rstd)
    out.copy_(tile * rstd * weight.float())


def rms_norm_backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, tile_tokens: int
) -> tuple[Tensor, Tensor]:
    """(dx, dweight) from the saved input and rstd, one tile of float32 work at a time."""
    flat = x.reshape(-1, x.shape[-1])
    grad_flat = grad_out.reshape(-1, x.shape[-1])
    grad_x = x.new_empty(x.shape)
    grad_x_flat = grad_x.view(flat.shape)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for start in tile_starts(flat, flat.shape[0], tile_tokens):
        rows = slice(start, start + tile_tokens)
        _normalize_backward_into(
            grad_x_flat[rows], grad_weight, flat[rows], rstd[rows], grad_flat[rows], weight
        )
    return grad_x, grad_weight.to(weight.dtype)


@fused
def _normalize_backward_into(
    grad_x: Tensor, grad_weight: Tensor, x: Tensor, rstd: Tensor, grad: Tensor, weight: Tensor
) -> None:
    """One tile: ``grad_x`` <- d loss / d x, ``grad_weight`` += its share (float32)."""
    tile, grad = x.float(), grad.float()
    grad_weight += (grad * (tile * rstd)).sum(0)
    grad_normed = grad * weight.float()
    # d/dx of x * r with r = (mean(x^2) + eps)^-1/2:  r * g - x * r^3 * mean(g * x)
    mean_gx = (grad_normed * tile).mean(-1, keepdim=True)
    grad_x.copy_(rstd * grad_normed - tile * rstd.pow(3) * mean_gx)


@torch.library.custom_op("upipe::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(x: Tensor, weight: Tensor, eps: float, tile_tokens: int) -> tuple[Tensor, Tensor]:
    return rms_norm_forward(x, weight, eps, tile_tokens)


@_rms_norm_fwd.register_fake
def _(x, weight, eps, tile_tokens):
    tokens = x.numel() // x.shape[-1]
    return torch.empty_like(x), x.new_empty(tokens, 1, dtype=torch.float32)


@torch.library.custom_op("upipe::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(
    grad_out: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, tile_tokens: int
) -> tuple[Tensor, Tensor]:
    return rms_norm_backward(grad_out, x, weight, rstd, tile_tokens)


@_rms_norm_bwd.register_fake
def _(grad_out, x, weight, rstd, tile_tokens):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _, tile_tokens = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.tile_tokens = tile_tokens


def _backward(ctx, grad_out: Tensor, _grad_rstd: Tensor | None):
    x, weight, rstd = ctx.saved_tensors
    return (*call(_BACKWARD, grad_out, x, weight, rstd, ctx.tile_tokens), None, None)


_rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
_FORWARD = OpSpec(_rms_norm_fwd, rms_norm_forward, _setup_context, _backward)
_BACKWARD = OpSpec(_rms_norm_bwd, rms_norm_backward)


def tiled_rms_norm(x: Tensor, weight: Tensor, eps: float, tile_tokens: int) -> Tensor:
    """Differentiable RMSNorm over the last dimension, ``tile_tokens`` tokens at a time."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be a positive number of tokens, got {tile_tokens}")
    out, _ = call(_FORWARD, x, weight, eps, tile_tokens)
    return out


class _TiledForward:
    """``nn.RMSNorm``'s forward computed ``tile_tokens`` tokens at a time (``tiled_rms_norm``),
    mixed into a subclass of the norm's own class that ``apply_tiled_rms_norm`` swaps in rather
    than a patched forward, so ``torch.compile`` guards every block's norm by the shared type
    (``memory.tiled_mlp`` says why) and the norm stays a torchtitan module (0.3.0 initialises
    only those). The weight is read per call (FSDP2 swaps it in)."""

    tile_tokens: int = 0
    """Tokens per tile; 0 means the model width."""

    def forward(self, x: Tensor) -> Tensor:
        """A sequence-parallel input (torch's ``SequenceParallel``: a ``Shard(1)`` DTensor) is
        normalised on its local rows (``runtime.sharded_compute.local_shard_op``)."""
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        tile = self.tile_tokens or x.shape[-1]
        return local_shard_op(lambda x, w: tiled_rms_norm(x, w, eps, tile), x, self.weight)


_TILED: dict[type[nn.Module], type[nn.Module]] = {}


def _tiled_class(cls: type[nn.Module]) -> type[nn.Module]:
    """One tiled subclass per norm class (``nn.RMSNorm``, torchtitan 0.3.0's ``RMSNorm``)."""
    if issubclass(cls, _TiledForward):
        return cls
    return _TILED.setdefault(cls, type(f"Tiled{cls.__name__}", (_TiledForward, cls), {}))


def apply_tiled_rms_norm(model: nn.Module, tile_tokens: int = 0) -> None:
    """Tile every ``nn.RMSNorm`` of the model (the blocks' two norms and the final norm).

    ``tile_tokens`` = 0 means the model width (one (dim x dim) float32 tile of work at a time).
    """
    if tile_tokens < 0:
        raise ValueError(f"[memory] norm_tile_tokens = {tile_tokens} must be >= 0 (0: automatic)")
    norms = [m for m in model.modules() if isinstance(m, nn.RMSNorm)]
    if any(m.weight is None or len(m.normalized_shape) != 1 for m in norms):
        raise ValueError("tiled RMSNorm needs RMSNorm over the last dimension with a weight")
    for norm in norms:
        norm.__class__ = _tiled_class(type(norm))
        norm.tile_tokens = tile_tokens
