"""The longest sequence that fits the budgets, found in a handful of plans.

At long context a plan's peak device memory and its host use are nearly linear in ``seq_len``:
a constant (model states, what CUDA holds) plus a few (S/C x D)-sized tensors. So instead of
doubling and bisecting (about ten plans for 3%), the search draws a line through two plans and
plans where that line crosses the budget (a secant step; with a single plan the line runs
through the plan's fixed part, ``Plan.device_fixed_bytes``). Then it confirms: it stops only when
it holds a length that fits and a failing one at most one tolerance longer, so the answer is a
length that fits, within the tolerance of where plans stop fitting. Where the curve bends (short
contexts, where constants dominate) each step is clamped inside the known bracket, and a secant
that keeps moving the same end gives way to a bisection step, so the search always finishes.

Typical cost: two plans to find the line, one near the crossing, one to close the bracket.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from upipe_dtensor.planning.step import Budget, Plan

GRANULE_TOKENS_PER_RANK = 1024
"""Lengths are searched in steps of this many tokens per CP rank: every layout (contiguous, ring
halves, FPDT chunks of S/2^k) splits such a length evenly."""
MAX_PLANS = 40
"""A safety net: a search that needs more plans than this has met a curve it cannot follow."""
MAX_GROWTH = 8
"""A step extrapolates at most this factor beyond the lengths planned so far."""


def tolerance(seq_len: int, granule: int, resolution: float) -> int:
    """How far above a fitting ``seq_len`` a failing one may be for the search to stop: a
    ``resolution`` fraction of it (in whole granules), and never less than one granule."""
    return max(granule, math.floor(resolution * seq_len / granule) * granule)


def _closing_step(failing: int, granule: int, resolution: float) -> int:
    """The largest distance d (granules) below a failing length such that a fit at
    ``failing - d`` closes the search: d <= tolerance(failing - d)."""
    return max(1, math.floor(resolution * failing / ((1 + resolution) * granule))) * granule


def _crossing(plans: list[Plan], budget: Budget) -> float | None:
    """Where the budgets are first exceeded on the line through ``plans`` (one or two plans); None
    when the line does not cross (memory that does not grow with the sequence)."""
    roots = []
    if len(plans) == 1:
        (plan,) = plans
        lines = [
            (
                plan.device_fixed_bytes,
                (plan.device_peak_bytes - plan.device_fixed_bytes) / plan.seq_len,
                budget.device_bytes,
            ),
            (0, plan.host_per_node_bytes / plan.seq_len, budget.host_bytes_per_node),
        ]
    else:
        first, second = plans
        run = second.seq_len - first.seq_len
        lines = []
        for use, limit in (
            (lambda p: p.device_peak_bytes, budget.device_bytes),
            (lambda p: p.host_per_node_bytes, budget.host_bytes_per_node),
        ):
            slope = (use(second) - use(first)) / run
            lines.append((use(first) - slope * first.seq_len, slope, limit))
    for intercept, slope, limit in lines:
        if slope > 0:
            roots.append((limit - intercept) / slope)
    return min(roots) if roots else None


def estimated_longest(plan: Plan, budget: Budget, granule: int) -> int | None:
    """The longest multiple of ``granule`` on the line through ``plan``'s fixed part and its
    peak (``_crossing``): an estimate from one plan, no search (None: memory does not grow)."""
    at = _crossing([plan], budget)
    return None if at is None else max(0, int(at // granule) * granule)


def longest_fitting(
    plan_at: Callable[[int], Plan],
    budget: Budget,
    *,
    start: int,
    granule: int,
    resolution: float,
    known: Plan | None = None,
) -> tuple[int, list[Plan]]:
    """The longest multiple of ``granule`` whose plan fits (0 if not even one granule does), and
    every plan used, in order. The answer fits; a plan at most ``tolerance(answer)`` longer does
    not (``resolution`` 0: exactly one granule longer). ``known``: a plan already made at the
    start length (a multiple of ``granule``), used instead of planning it again."""
    plans: list[Plan] = []
    fit: Plan | None = None  # the longest fitting plan so far
    fail: Plan | None = None  # the shortest failing plan so far
    moved: list[bool] = []  # inside the bracket: whether each plan fitted, to notice a stall

    def round_down(length: float) -> int:
        return max(granule, int(length // granule) * granule)

    seq_len = round_down(start)
    while len(plans) < MAX_PLANS:
        plan = known if known is not None and seq_len == known.seq_len else plan_at(seq_len)
        plans.append(plan)
        if fit and fail:
            moved.append(plan.fits)
        if plan.fits:
            fit = plan if fit is None or plan.seq_len > fit.seq_len else fit
        else:
            fail = plan if fail is None or plan.seq_len < fail.seq_len else fail
        if fail is not None and fail.seq_len <= granule:
            return 0, plans
        if (
            fit
            and fail
            and fail.seq_len - fit.seq_len <= tolerance(fit.seq_len, granule, resolution)
        ):
            return fit.seq_len, plans
        if fit and fail:
            line = [fit, fail]
        else:  # the two plans nearest the crossing: the longest fitting or the shortest failing
            ordered = sorted(plans, key=lambda p: p.seq_len)
            line = ordered[-2:] if fit else ordered[:2]
            line = line if len(line) == 2 else [plan]
        crossing = _crossing(line, budget)
        if fail is None:  # still looking for a length that does not fit: grow
            reach = MAX_GROWTH * fit.seq_len
            guess = 2 * fit.seq_len if crossing is None else min(crossing, reach)
            seq_len = max(
                round_down(guess), fit.seq_len + tolerance(fit.seq_len, granule, resolution)
            )
        elif fit is None:  # still looking for one that fits: shrink
            guess = (
                fail.seq_len / 2 if crossing is None else max(crossing, fail.seq_len / MAX_GROWTH)
            )
            seq_len = min(round_down(guess), fail.seq_len - granule)
        else:  # bracketed: step inside it, near the crossing, so that one outcome closes it
            lowest = fit.seq_len + tolerance(fit.seq_len, granule, resolution)
            highest = fail.seq_len - _closing_step(fail.seq_len, granule, resolution)
            stalled = len(moved) >= 2 and moved[-1] == moved[-2]  # the secant creeps from one side
            if crossing is None or stalled or lowest > highest:
                seq_len = round_down((fit.seq_len + fail.seq_len) / 2)
            else:
                seq_len = min(max(round_down(crossing), lowest), highest)
            seq_len = min(max(seq_len, fit.seq_len + granule), fail.seq_len - granule)
    raise RuntimeError(
        f"the sequence-length search made {MAX_PLANS} plans without closing in on the limit: "
        + ", ".join(f"{p.seq_len:,} ({'fits' if p.fits else 'fails'})" for p in plans)
    )
