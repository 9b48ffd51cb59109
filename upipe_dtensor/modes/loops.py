"""The planner's shortcut through loops of identical iterations (``kernels.tiling``).

On fake tensors a tile or chunk loop visits its first two iterations and its last one; while a
visited iteration runs, ``repeats`` says how many real ones it stands for (loops nest, so the
factors multiply), and the planner's counters (``planning.step_work``, ``planning.rehearsal``,
``planning.replay``) weigh what they count by it. ``_every_tile_when_planning`` turns the
shortcut off (the tests that check a plan with every iteration equals one with the shortcut set
it); ``kernels.tiling`` asks ``every_tile_when_planning``.
"""

from __future__ import annotations

_every_tile_when_planning = False
_repeats = 1.0


def every_tile_when_planning() -> bool:
    """Whether fake-tensor loops visit every iteration (the shortcut off)."""
    return _every_tile_when_planning


def repeats() -> float:
    """How many real iterations the running one stands for (1 outside shortened loops)."""
    return _repeats


def set_repeats(value: float) -> None:
    """What the running iteration stands for, set by ``kernels.tiling``'s loops as they visit
    one (and set back to the outer loop's value after)."""
    global _repeats
    _repeats = value
