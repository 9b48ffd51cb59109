"""Sequence-tiled SwiGLU MLP: ``w2(silu(w1 x) * w3 x)`` over tiles of tokens.

At multi-million-token contexts the MLP's hidden activations, tokens x F with F ~3.5x the model
width D, are the largest tensors of a layer, and plain autograd keeps four of them for backward
(``w1 x`` for silu, ``silu(w1 x)`` and ``w3 x`` for the product, the product for ``w2``). Here
the N local tokens (all leading dimensions flattened) run in tiles of T, and backward recomputes
each tile's hidden state from the saved input instead.

Memory bound (bytes b per element):
  saved    : x (N*D*b) and references to the weights; no hidden activation.
  forward  : the output buffer (N*D*b) + one tile's hidden state, at most 2 T*F tensors at once.
  backward : dx (N*D*b), float32 accumulators for dw1, dw2, dw3 (3*F*D*4, independent of N)
             + one tile's recomputed hidden state and its gradients, at most ~5 T*F tensors.
With T = D (the default of ``apply_tiled_mlp``) the per-tile terms are the size of a weight, so
the MLP's activation memory grows as N*D instead of N*F.

The loops are a ``torch.library.custom_op`` pair, so ``torch.compile(fullgraph=True)`` sees one
opaque node per direction and cannot fuse the tiles back into whole-sequence tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from upipe_dtensor.kernels.op_mode import OpSpec, call
from upipe_dtensor.kernels.tiling import tile_starts
from upipe_dtensor.memory.swiglu_parts import (
    grad_of_product_,
    grad_of_silu_,
    silu_times,
    silu_times_,
)
from upipe_dtensor.memory.tiled_moe import moe_modules, tile_moe
from upipe_dtensor.runtime.sharded_compute import gathered_input, local_weight, reduced_output


def _accumulate(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b with acc in float32. Low-precision tiles are multiplied in their own dtype
    (the GEMM accumulates in float32 inside) and only the per-tile partial is rounded."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)


def tiled_swiglu_forward(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, tile_tokens: int) -> Tensor:
    """The forward tile loop; each output tile is written straight into one buffer."""
    x_flat = x.reshape(-1, x.shape[-1])
    out = x.new_empty(*x.shape[:-1], w2.shape[0])  # not a view: it may be a compiled block's output
    out_flat = out.view(x_flat.shape[0], w2.shape[0])
    for start in tile_starts(x_flat, x_flat.shape[0], tile_tokens):
        x_t = x_flat[start : start + tile_tokens]
        h = x_t @ w1.t()
        silu_times_(h, x_t @ w3.t())
        torch.mm(h, w2.t(), out=out_flat[start : start + tile_tokens])
        del h
    return out


def tiled_swiglu_backward(
    grad_out: Tensor, x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, tile_tokens: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Recompute each tile's hidden state and backpropagate it; returns (dx, dw1, dw2, dw3)."""
    x_flat = x.reshape(-1, x.shape[-1])
    grad_flat = grad_out.reshape(-1, w2.shape[0])
    grad_x = x.new_empty(x.shape)
    grad_x_flat = grad_x.view(x_flat.shape)
    grad_w1, grad_w2, grad_w3 = (torch.zeros_like(w, dtype=torch.float32) for w in (w1, w2, w3))
    for start in tile_starts(x_flat, x_flat.shape[0], tile_tokens):
        x_t = x_flat[start : start + tile_tokens]
        g_t = grad_flat[start : start + tile_tokens]
        a = x_t @ w1.t()
        b = x_t @ w3.t()
        _accumulate(grad_w2, g_t.t(), silu_times(a, b))
        grad_h = g_t @ w2
        grad_b = grad_of_product_(grad_h, a, b)
        del b
        grad_of_silu_(a, grad_h)
        grad_a = a
        del a, grad_h
        rows = grad_x_flat[start : start + tile_tokens]
        torch.mm(grad_a, w1, out=rows)
        rows.addmm_(grad_b, w3)
        _accumulate(grad_w1, grad_a.t(), x_t)
        _accumulate(grad_w3, grad_b.t(), x_t)
        del grad_a, grad_b
    return (
        grad_x,
        grad_w1.to(w1.dtype),
        grad_w2.to(w2.dtype),
        grad_w3.to(w3.dtype),
    )


# --- registration: one opaque op per direction, so torch.compile keeps the tiling -------------


@torch.library.custom_op("upipe::tiled_swiglu_fwd", mutates_args=())
def _tiled_swiglu_fwd(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, tile_tokens: int) -> Tensor:
    return tiled_swiglu_forward(x, w1, w2, w3, tile_tokens)


@_tiled_swiglu_fwd.register_fake
def _(x, w1, w2, w3, tile_tokens):
    return x.new_empty(*x.shape[:-1], w2.shape[0])


@torch.library.custom_op("upipe::tiled_swiglu_bwd", mutates_args=())
def _tiled_swiglu_bwd(
    grad_out: Tensor, x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, tile_tokens: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tiled_swiglu_backward(grad_out, x, w1, w2, w3, tile_tokens)


@_tiled_swiglu_bwd.register_fake
def _(grad_out, x, w1, w2, w3, tile_tokens):
    return (
        x.new_empty(x.shape),
        w1.new_empty(w1.shape),
        w2.new_empty(w2.shape),
        w3.new_empty(w3.shape),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, w1, w2, w3, tile_tokens = inputs
    ctx.save_for_backward(x, w1, w2, w3)
    ctx.tile_tokens = tile_tokens


def _backward(ctx, grad_out: Tensor):
    x, w1, w2, w3 = ctx.saved_tensors
    return (*call(_BACKWARD, grad_out, x, w1, w2, w3, ctx.tile_tokens), None)


_tiled_swiglu_fwd.register_autograd(_backward, setup_context=_setup_context)
_FORWARD = OpSpec(_tiled_swiglu_fwd, tiled_swiglu_forward, _setup_context, _backward)
_BACKWARD = OpSpec(_tiled_swiglu_bwd, tiled_swiglu_backward)


def tiled_swiglu(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, tile_tokens: int) -> Tensor:
    """Differentiable ``w2(silu(w1 x) * w3 x)`` computed ``tile_tokens`` tokens at a time.

    ``x`` is (..., D), its leading dimensions flattened to tokens; ``w1``, ``w3`` are (F, D) and
    ``w2`` is (D, F), as in ``nn.Linear``. Only ``x`` is saved for backward (module docstring).
    """
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be a positive number of tokens, got {tile_tokens}")
    return call(_FORWARD, x, w1, w2, w3, tile_tokens)


class _TiledForward:
    """The forward of a family's SwiGLU MLP computed ``tile_tokens`` tokens at a time
    (``tiled_swiglu``), mixed into a subclass of the MLP's own class (``tiled_mlp_class``).

    A subclass that ``apply_tiled_mlp`` swaps in, not a forward patched onto each module:
    ``torch.compile`` guards a patched forward by its identity, so every block would compile
    again (and fullgraph compilation fails past dynamo's recompile limit, 8 blocks); a class is
    guarded by its type, which every block shares. It keeps the MLP's class (torchtitan 0.3.0
    initialises only its own ``Module``s). Weights are read per call, so FSDP2's unsharded
    parameters (swapped in for the forward) are the ones used.
    """

    tile_tokens: int = 0
    """Tokens per tile; 0 means the model width D."""

    def forward(self, x: Tensor) -> Tensor:
        """Under tensor parallelism (``w1``/``w3`` column-wise, ``w2`` row-wise: DTensors) on
        this rank's columns of the hidden state: the sequence-parallel input gathered, the partial
        output reduced back into it (``runtime.sharded_compute``)."""
        w2 = self.w2.weight
        mesh = w2.device_mesh if isinstance(w2, DTensor) else None
        local = gathered_input(x, mesh)
        y = tiled_swiglu(
            local,
            local_weight(self.w1.weight),
            local_weight(w2),
            local_weight(self.w3.weight),
            self.tile_tokens or x.shape[-1],
        )
        return reduced_output(y, x, mesh)


_SWIGLU_MLPS: dict[type[nn.Module], type[nn.Module]] = {}
"""MLP classes that compute ``w2(silu(w1(x)) * w3(x))`` with bias-free ``w1``, ``w2``, ``w3``
(each model family registers its own: ``models.family``), and their tiled subclasses."""


def register_swiglu_mlp(cls: type[nn.Module]) -> None:
    """Let ``apply_tiled_mlp`` tile ``cls`` modules (a family's SwiGLU MLP, as Llama3's)."""
    _SWIGLU_MLPS.setdefault(cls, type(f"Tiled{cls.__name__}", (_TiledForward, cls), {}))


def is_tiled_mlp(module: nn.Module) -> bool:
    """Whether ``module`` computes its MLP tiled (and takes its tensor-parallel input as it
    arrives: ``models.tensor_parallel``)."""
    return isinstance(module, _TiledForward)


def tiled_mlp_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The tiled subclass of a registered SwiGLU MLP class."""
    return _SWIGLU_MLPS[cls]


def _check_swiglu(module: nn.Module | None, path: str) -> None:
    cls = type(module)
    is_swiglu = (cls in _SWIGLU_MLPS or cls in _SWIGLU_MLPS.values()) and all(
        getattr(module, name).bias is None for name in ("w1", "w2", "w3")
    )
    if not is_swiglu:
        raise ValueError(
            f"{path} is {type(module).__name__}, not a registered bias-free SwiGLU MLP "
            f"(w2(silu(w1(x)) * w3(x))), the only MLP the tiled MLP computes; set "
            f"[memory] tiled_mlp = false for this model"
        )


def apply_tiled_mlp(model: nn.Module, tile_tokens: int = 0) -> None:
    """Run every ``model.layers[*].feed_forward`` over tiles of ``tile_tokens`` tokens; in a
    mixture-of-experts block, the whole MoE over tiles of as many tokens (``memory.tiled_moe``).

    ``tile_tokens == 0`` picks the model width D, so the per-tile hidden state is the size of a
    weight matrix (ceil(tokens / D) tiles, as in DeepSpeed ALST). Apply before ``torch.compile``
    and ``fully_shard``; applying again replaces the tile size.
    """
    if tile_tokens < 0:
        raise ValueError(
            f"tile_tokens must be >= 0 (0 = model width), got {tile_tokens}; "
            f"fix [memory] mlp_tile_tokens"
        )
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        raise ValueError(
            f"{type(model).__name__} has no `layers` container of TransformerBlocks; "
            f"apply_tiled_mlp expects a torchtitan Transformer of a registered model family"
        )
    blocks = layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers)
    modules, experts = [], []
    for name, block in blocks:
        moe = moe_modules(block)
        if moe:  # a mixture of experts, whose shared experts it runs inside
            experts += moe
            continue
        path = f"layers.{name}.feed_forward"
        module = getattr(block, "feed_forward", None)
        _check_swiglu(module, path)
        modules.append(module)
    for module in modules:
        if not isinstance(module, _TiledForward):
            module.__class__ = tiled_mlp_class(type(module))
        module.tile_tokens = tile_tokens
    for module in experts:
        tile_moe(module, tile_tokens)
