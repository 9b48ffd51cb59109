"""How often a job should save, from its predicted step time.

A stop signal can only save at a step boundary, and a rank that dies saves nothing, so what a
crash, a preemption or a Ctrl-C during a long step costs is the work since the last periodic
snapshot. At 1M tokens a step of Llama3-8B is predicted at minutes, at 5M at hours, so the
default ``[checkpoint] interval`` of 500 steps would put days between snapshots. The planner
suggests the largest interval whose snapshots are at most ``MAX_LOST_SECONDS`` of work apart
(every step when one step takes longer).
"""

from __future__ import annotations

import math

MAX_LOST_SECONDS = 3600.0
"""The most work, in seconds of training, a crash should cost: one hour."""


def suggested_interval(step_seconds: float, max_lost_seconds: float = MAX_LOST_SECONDS) -> int:
    """Steps between snapshots so that at most ``max_lost_seconds`` of work is lost (at least 1)."""
    if step_seconds <= 0:
        raise ValueError(f"a step time must be > 0 seconds, got {step_seconds}")
    return max(1, math.floor(max_lost_seconds / step_seconds))


def interval_line(step_seconds: float, interval: int) -> str:
    """The plan's line suggesting ``[checkpoint] interval`` (the job's own is ``interval``)."""
    suggested = suggested_interval(step_seconds)
    return (
        f"  checkpoint interval  : {suggested} step{'s' * (suggested != 1)} suggested (a snapshot "
        f"every {suggested * step_seconds / 3600:.2g} h of predicted work, the most a crash or a "
        f"stop during a long step loses; this job: [checkpoint] interval = {interval})"
    )
