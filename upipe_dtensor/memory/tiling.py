"""Tile loops of the sequence-tiled ops (MLP, RMSNorm, RoPE, loss), and how the planner runs them.

A tiled op allocates its outputs and accumulators before the loop and, in each iteration, the
temporaries of one tile, freed before the next. Every full tile therefore allocates exactly what
the first one did, and only the last tile may be shorter. On fake tensors (the memory planner,
which tracks allocations, not values) ``tile_starts`` visits the first two tiles and the last one:
the same allocations, the same peak, without the thousands of identical iterations that make a
multi-million-token plan slow. Real tensors always visit every tile.
(tests/test_planner.py checks that a plan with every tile equals one with the shortcut.)
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

_every_tile_when_planning = False


def tile_starts(like: Tensor, total: int, tile: int) -> list[int] | range:
    """Start offsets of ``tile``-sized tiles over ``total`` rows of ``like``'s computation."""
    starts = range(0, total, tile)
    if torch.compiler.is_compiling():  # traced by torch.compile: every tile, as at run time
        return starts
    if is_fake(like) and not _every_tile_when_planning and len(starts) > 3:
        return [starts[0], starts[1], starts[-1]]
    return starts
