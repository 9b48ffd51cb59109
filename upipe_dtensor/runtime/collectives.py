"""Small agreements between ranks, so a failure seen by one rank stops every rank the same way
instead of leaving the others waiting in a collective."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_dicts(local: dict) -> dict:
    """The union of every rank's dict, on every rank."""
    parts: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, local)
    return {key: value for part in parts for key, value in part.items()}


def _picklable(err: Exception) -> Exception:
    try:
        pickle.dumps(err)
    except Exception:
        return RuntimeError(f"rank {dist.get_rank()}: {err!r}")
    return err


def _alone() -> bool:
    """True on the memory planner's fake process group: this process plays rank 0 and the other
    ranks do not exist, so there is nobody to agree with (and its collectives move no data)."""
    return dist.get_backend() == "fake"


def outcome_on_every_rank(fn: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """Run ``fn`` on every rank: (its result, None) where it succeeded on every rank, else
    (None, the lowest failing rank's exception) on every rank, for a caller that reports the
    failure and goes on (``gpu_check``'s rows)."""
    try:
        result, failure = fn(), None
    except Exception as err:  # agreed on below
        result, failure = None, _picklable(err)
    if _alone():
        return result, failure
    failures: list[Exception | None] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    first = next((f for f in failures if f is not None), None)
    return (None, first) if first is not None else (result, None)


def on_every_rank(fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it fails anywhere, every rank raises the lowest failing rank's
    exception (so rank 0, which prints job messages, reports a failure seen only by rank 3)."""
    if _alone():
        return fn()
    result, failure = outcome_on_every_rank(fn)
    if failure is not None:
        raise failure
    return result  # type: ignore[return-value]


def on_rank0(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only; every rank returns its result or raises its exception."""
    if _alone():
        return fn()
    outcome: tuple[bool, Any] | None = None
    if dist.get_rank() == 0:
        try:
            outcome = (True, fn())
        except Exception as err:  # re-raised below, on every rank
            outcome = (False, _picklable(err))
    ok, value = broadcast(outcome)
    if not ok:
        raise value
    return value
