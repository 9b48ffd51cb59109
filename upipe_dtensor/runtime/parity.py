"""Comparing a context-parallel model with the unsharded one: shard a batch in a style's layout,
put the shards back together, sum each rank's partial gradients, measure relative errors.

The tests (through ``tests/harness.py``) and the GPU check (``verify.gpu_check``) both call these,
so a number printed on a GPU means what the CPU tests assert.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def shard(t: torch.Tensor, rank: int, world_size: int, style=None) -> torch.Tensor:
    """This rank's tokens of the sequence dimension (dim 1): the style's layout
    (``shard_positions``), or the contiguous slice when no style is given."""
    if style is None:
        local = t.shape[1] // world_size
        return t[:, rank * local : (rank + 1) * local]
    positions = style.shard_positions(t.shape[1], rank, world_size).to(t.device)
    return t.index_select(1, positions)


def gather_sequence(local: torch.Tensor, style=None, group=None) -> torch.Tensor:
    """The whole sequence (dim 1) from every rank's shard: rank order, or each token put back at
    its global position by the style's ``shard_positions``."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    joined = torch.cat(parts, dim=1)
    if style is None:
        return joined
    seq_len = joined.shape[1]
    positions = torch.cat([style.shard_positions(seq_len, r, world) for r in range(world)])
    return torch.empty_like(joined).index_copy_(1, positions.to(joined.device), joined)


def summed_grads(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """Parameter gradients summed over the ranks in float32 (each rank's are partial: its shard's
    tokens), as FSDP2's reduce_dtype = float32 sums them."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grad = grad.detach().float().clone()
        dist.all_reduce(grad, group=group)
        grads[name] = grad
    return grads


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters only: ``model.to(dtype)`` would also cast the complex RoPE buffer to real."""
    for param in model.parameters():
        param.data = param.data.to(dtype)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def worst_grad_err(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest relative error over every parameter's gradient."""
    return max(rel_err(grads[name], reference[name]) for name in reference)
