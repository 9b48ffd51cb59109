"""A mixture-of-experts block over tiles of tokens: the dense tiled MLP's rule for torchtitan's
``MoE`` (router, token permutation, grouped experts, combine).

At long context an MoE block holds, per token, the router's scores over every expert (float32),
the routing map, and top-k copies of the token for the experts and back (R = tokens x top-k
rows of width D), on top of the experts' own hidden states; autograd keeps most of them for
backward, so the block's memory grows with the sequence times top-k. Here the block's forward
runs ``tile_tokens`` tokens at a time, each tile under activation checkpointing
(``torch.utils.checkpoint``, non-reentrant): forward holds one tile's routing and experts at
once and keeps only the tiles' outputs; backward recomputes each tile's routing and experts
from the block's input, one tile at a time. Routing is per token, so tiles change no number.

torchtitan's MoE counts each token's experts (``tokens_per_expert_E``, for its load balancing)
in forward, and a tile's recompute counts it again, as torchtitan's own activation
checkpointing does; the expert-bias update reads only the sign of each expert's deviation from
the mean, which a uniform factor of 2 does not change.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from upipe_dtensor.kernels.tiling import tile_starts


class _TiledMoEForward:
    """The forward of a registered MoE class over tiles of ``tile_tokens`` tokens, mixed into
    a subclass of that class (as ``tiled_mlp`` does for a dense MLP)."""

    tile_tokens: int = 0
    """Tokens per tile; 0 means the model width D."""

    def forward(self, x: Tensor) -> Tensor:
        batch, length, dim = x.shape
        tokens = x.reshape(1, batch * length, dim)
        tile = self.tile_tokens or dim
        moe_forward = super().forward
        out = tokens.new_empty(tokens.shape)
        for start in tile_starts(tokens, batch * length, tile):
            piece = tokens[:, start : start + tile]
            out[:, start : start + tile] = checkpoint(moe_forward, piece, use_reentrant=False)
        return out.view(batch, length, dim)


_MOE_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}
"""MoE classes (``forward(x (B, L, D)) -> (B, L, D)``, per token) and their tiled subclasses."""


def register_moe(cls: type[nn.Module]) -> None:
    """Let ``apply_tiled_mlp`` tile ``cls`` modules (a family's mixture-of-experts block)."""
    _MOE_CLASSES.setdefault(cls, type(f"Tiled{cls.__name__}", (_TiledMoEForward, cls), {}))


def moe_modules(block: nn.Module) -> list[nn.Module]:
    """The registered MoE modules of a transformer block (tiled or not)."""
    classes = (*_MOE_CLASSES, *_MOE_CLASSES.values())
    return [module for module in block.modules() if type(module) in classes]


def is_tiled_moe(module: nn.Module) -> bool:
    """Whether ``module`` is a registered MoE running over tiles of tokens."""
    return isinstance(module, _TiledMoEForward)


def tile_moe(module: nn.Module, tile_tokens: int) -> None:
    """Run ``module`` (a registered MoE) over tiles of ``tile_tokens`` tokens (0: width D)."""
    if not isinstance(module, _TiledMoEForward):
        module.__class__ = _MOE_CLASSES[type(module)]
    module.tile_tokens = tile_tokens
