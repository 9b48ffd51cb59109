"""How the project's custom ops run while the planner (or the stand-in run) watches them.

``transparent_ops``: inside, ``kernels.op_mode.call`` runs an op's Python body through a plain
autograd Function instead of the opaque ``torch.library`` op, so every allocation inside it
reaches the dispatch modes (the memory planner's tracker, FakeTensorMode); ``kernels.op_mode``
asks ``ops_transparent``. ``computations_run_by``: inside, the attention ops' computations
(``parallel.attention_op``, which asks ``computation_runner``) go through the planner's runner,
which replays one traced on the same arguments (``planning.replay``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import Tensor

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


ComputationRunner = Callable[[str, tuple, Callable[[], tuple[Tensor, ...]]], tuple[Tensor, ...]]
"""``runner(name, args, compute)``: ``compute()``, an op's computation on the op's arguments
``args``, or what stands for it (``planning.replay``)."""
_runner: ComputationRunner | None = None


@contextlib.contextmanager
def computations_run_by(runner: ComputationRunner) -> Iterator[None]:
    """Attention computations (each op's forward without kept attention, and its backward) go
    through ``runner`` here: the memory planner replays one traced on the same arguments."""
    global _runner
    previous, _runner = _runner, runner
    try:
        yield
    finally:
        _runner = previous


def computation_runner() -> ComputationRunner | None:
    """The runner attention computations go through now (None: they run as they are)."""
    return _runner
