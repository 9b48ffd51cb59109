"""Caches that must not outlive one trace of the planner (``planning.step``): a runtime module
that caches tensors across calls (``parallel.head_stages.head_index``) registers its cache with
``per_trace``, and the planner calls ``forget_per_trace_caches`` before and after each traced
step, so a plan's fake tensors never reach the next plan and each plan counts the tensors it
creates. The planner thus asks this package, never the module that keeps the cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar


class _Cached(Protocol):
    def cache_clear(self) -> None: ...


CachedT = TypeVar("CachedT", bound=_Cached)

_forgets: list[Callable[[], None]] = []


def per_trace(cached: CachedT) -> CachedT:
    """Register ``cached`` (a ``functools.cache``'d function) to be emptied between traces;
    returns it, so it stacks on top of ``@functools.cache`` as a decorator."""
    _forgets.append(cached.cache_clear)
    return cached


def forget_per_trace_caches() -> None:
    """Empty every cache registered with ``per_trace``."""
    for forget in _forgets:
        forget()
