"""Tile loops of the sequence-tiled ops (MLP, RMSNorm, RoPE, loss), and how the planner runs them.

A tiled op allocates its outputs and accumulators before the loop and, in each iteration, the
temporaries of one tile, freed before the next. Every full tile therefore allocates exactly what
the first one did, and only the last tile may be shorter. On fake tensors (the memory planner,
which tracks allocations, not values) ``tile_starts`` visits the first two tiles and the last one:
the same allocations, the same peak, without the thousands of identical iterations that make a
multi-million-token plan slow. Real tensors always visit every tile. FPDT's chunk loops
(``parallel.fpdt_attention``) use the same rule for their quadratic chunk pairs.
(tests/test_planner.py checks that a plan with every tile equals one with the shortcut.)
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

_every_tile_when_planning = False


def visited(like: Tensor, steps: range) -> list[int] | range:
    """The iterations of a loop of identical steps over ``like``'s computation to run: all of
    them, except on fake tensors, where the first two and the last are enough."""
    if torch.compiler.is_compiling():  # traced by torch.compile: every step, as at run time
        return steps
    if is_fake(like) and not _every_tile_when_planning and len(steps) > 3:
        return [steps[0], steps[1], steps[-1]]
    return steps


def tile_starts(like: Tensor, total: int, tile: int) -> list[int] | range:
    """Start offsets of ``tile``-sized tiles over ``total`` rows of ``like``'s computation."""
    return visited(like, range(0, total, tile))
