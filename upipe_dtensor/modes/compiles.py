"""Whether plans share their compiled graphs (``planning.compiled.shared_compiles``, around the
plans of a search): inside, a plan keeps the graphs the plans before it compiled, and
``planning.compiled.fresh_compiles`` asks ``compiles_shared`` before it empties dynamo's caches."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_shared = False


@contextlib.contextmanager
def sharing_compiles() -> Iterator[None]:
    """Inside, plans share their compiled graphs (``planning.compiled.shared_compiles`` adds the
    resets of dynamo's caches around the outermost scope)."""
    global _shared
    previous, _shared = _shared, True
    try:
        yield
    finally:
        _shared = previous


def compiles_shared() -> bool:
    """Whether plans share their compiled graphs now."""
    return _shared
