"""The planner's rehearsal of a CUDA job on stand-ins (``planning.rehearsal``): inside
``rehearsing``, the device-runtime seam's copies (``runtime.host_store``, which asks
``is_rehearsing``) carry the CUDA branch's flags (``non_blocking``, from buffers it pins) on the
stand-ins, and its buffers count as pinned, so the rehearsal sees the copies CUDA would make."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_rehearsing = False


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
