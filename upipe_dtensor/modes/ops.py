"""How the project's custom ops run while the planner (or the stand-in run) watches them.

``transparent_ops``: inside, ``kernels.op_mode.call`` runs an op's Python body through a plain
autograd Function instead of the opaque ``torch.library`` op, so every allocation inside it
reaches the dispatch modes (the memory planner's tracker, FakeTensorMode); ``kernels.op_mode``
asks ``ops_transparent``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_transparent = False


@contextlib.contextmanager
def transparent_ops() -> Iterator[None]:
    """Inside, the project's custom ops run their Python bodies in the open (module docstring)."""
    global _transparent
    previous, _transparent = _transparent, True
    try:
        yield
    finally:
        _transparent = previous


def ops_transparent() -> bool:
    """Whether the project's custom ops run their bodies in the open now."""
    return _transparent
