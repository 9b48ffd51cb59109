"""The planner's rehearsal of a CUDA job on stand-ins (``planning.rehearsal``): inside
``rehearsing``, the device-runtime seam's copies (``runtime.host_store``, which asks
``is_rehearsing``) carry the CUDA branch's flags (``non_blocking``, from buffers it pins) on the
stand-ins, and its buffers count as pinned, so the rehearsal sees the copies CUDA would make.
Inside ``compiled_calls_inside``, every compiled ``@fused`` call (``kernels.fused``, which asks
``around_compiled_calls``) runs inside the rehearsal's context: its torch-function mode off, since
dynamo traces the torch-function modes it finds."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

_rehearsing = False
_around_calls: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


@contextlib.contextmanager
def rehearsing() -> Iterator[None]:
    """Inside, ``runtime.host_store`` takes its CUDA branch on the planner's stand-ins."""
    global _rehearsing
    previous, _rehearsing = _rehearsing, True
    try:
        yield
    finally:
        _rehearsing = previous


def is_rehearsing() -> bool:
    """Whether the planner rehearses a CUDA job now."""
    return _rehearsing


@contextlib.contextmanager
def compiled_calls_inside(
    context: Callable[[], contextlib.AbstractContextManager],
) -> Iterator[None]:
    """Run every compiled ``@fused`` call inside ``context()`` while this is on: the planner's
    GPU rehearsal takes its torch-function mode off there, since dynamo traces the torch-function
    modes it finds (``planning.rehearsal``)."""
    global _around_calls
    previous, _around_calls = _around_calls, context
    try:
        yield
    finally:
        _around_calls = previous


def around_compiled_calls() -> Callable[[], contextlib.AbstractContextManager]:
    """The context every compiled ``@fused`` call runs in now (``contextlib.nullcontext``
    outside a rehearsal)."""
    return _around_calls
