"""Tile loops of the sequence-tiled ops (MLP, RMSNorm, RoPE, loss), and how the planner runs them.

A tiled op allocates its outputs and accumulators before the loop and, in each iteration, the
temporaries of one tile, freed before the next. Every full tile therefore allocates exactly what
the first one did, and only the last tile may be shorter. On fake tensors (the memory planner,
which tracks allocations, not values) ``tile_starts`` visits the first two tiles and the last one:
the same allocations, the same peak, without the thousands of identical iterations that make a
multi-million-token plan slow. Real tensors always visit every tile. FPDT's chunk loops
(``parallel.fpdt_attention``) use the same rule for their chunks and quadratic chunk pairs; what
a skipped chunk leaves in host memory is parked as a stand-in (``in_order``).
(tests/test_planner.py checks that a plan with every tile equals one with the shortcut.)

What the planner *counts* (FLOPs, bytes: ``planning.step_work``) must cover every iteration, so
while a visited iteration runs, ``repeats()`` says how many real ones it stands for: the second
visit stands for every middle iteration (loops nest, so the factors multiply). Both the shortcut's
switch and ``repeats()`` are planner modes, in ``modes.loops``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from upipe_dtensor.modes.loops import every_tile_when_planning, repeats, set_repeats
from upipe_dtensor.runtime.torch_private import is_fake


class _Visits(list):
    """The visited iterations; iterating sets ``repeats()`` for each one's body."""

    def __init__(self, values: list[int], weights: list[float]) -> None:
        super().__init__(values)
        self.weights = weights

    def __iter__(self):
        outer = repeats()
        try:
            for value, weight in zip(list.__iter__(self), self.weights):
                set_repeats(outer * weight)
                yield value
        finally:
            set_repeats(outer)


def visited(like: Tensor, steps: range, stands_for: float | None = None) -> list[int] | range:
    """The iterations of a loop of identical steps over ``like``'s computation to run: all of
    them, except on fake tensors, where the first two and the last are enough. ``stands_for``:
    how many iterations the loop counts as (default ``len(steps)``), for a loop that itself stands
    for several of different lengths; the second visit takes what the other two do not."""
    if torch.compiler.is_compiling():  # traced by torch.compile: every step, as at run time
        return steps
    total = len(steps) if stands_for is None else stands_for
    if is_fake(like) and not every_tile_when_planning() and len(steps) > 3:
        return _Visits([steps[0], steps[1], steps[-1]], [1.0, total - 2, 1.0])
    if total != len(steps):  # the second (or only) step takes the difference, as above
        weights = [1.0] * len(steps)
        weights[min(1, len(steps) - 1)] += total - len(steps)
        return _Visits(list(steps), weights)
    return steps


def in_order(
    visits: list[int] | range, steps: range, skipped: Callable[[int], None]
) -> Iterator[int]:
    """The ones of ``steps`` that ``visits`` (``visited``'s choice) runs, in order, and for each
    one it skips ``skipped(step)`` where that step would run: while a visited step's body runs,
    ``repeats()`` is what it stands for; ``skipped`` runs with ``repeats()`` 0, for a loop whose
    skipped iterations still leave memory behind (FPDT's host copies of every chunk): the
    stand-ins it makes for them cost memory and count no work, which the visited steps count.
    Off the planner every step runs and ``skipped`` is never called, so a loop has no branch of
    its own for the planner."""
    weights = dict(zip(visits, getattr(visits, "weights", [1.0] * len(visits))))
    outer = repeats()
    try:
        for step in steps:
            weight = weights.get(step)
            set_repeats(outer * (0.0 if weight is None else weight))
            if weight is None:
                skipped(step)
            else:
                yield step
    finally:
        set_repeats(outer)


def tile_starts(like: Tensor, total: int, tile: int) -> list[int] | range:
    """Start offsets of ``tile``-sized tiles over ``total`` rows of ``like``'s computation."""
    return visited(like, range(0, total, tile))
