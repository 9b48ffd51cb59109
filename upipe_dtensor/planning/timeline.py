"""A traced step recorded phase by phase, and the full-depth step rebuilt from a reduced-depth
one (``planning.depth``).

``StepTimeline`` records, from the step's start (``LiveMemoryTracker.start_step``), every
allocation and free the tracker counts, in order, and at each change of the tracker's ``when``
(a unit's forward or backward, the output head, the optimizer step) what the step-time counter
and the GPU rehearsal have counted so far.

``expand`` plays the recorded events again through the tracker's own rules (per device, a peak
is the first moment the running total exceeds every earlier one; the labels alive then are its
breakdown), with the copies of the periods the reduction names inserted right after them. A
period repeated k times is not played k times: its running total peaks at the same place in every
copy, so the highest copy is the first (the period frees at least what it allocates) or the last
(it leaves memory behind). The counted work and the rehearsal's calls are the traced step's plus
k times each copied period's.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from upipe_dtensor.planning.depth import DepthReduction
from upipe_dtensor.planning.rehearsal import GpuRehearsal, RehearsalReport
from upipe_dtensor.planning.step_work import StepWork, StepWorkCounter
from upipe_dtensor.planning.tracker import Peak


@dataclass
class _Mark:
    """A change of phase, and what was counted up to it."""

    when: str
    work: StepWork | None
    report: RehearsalReport | None


class StepTimeline:
    """The step's allocations and frees, ``(device, label, bytes)``, in order, between the marks
    of its phases (``LiveMemoryTracker.timeline``)."""

    def __init__(
        self, counter: StepWorkCounter | None = None, rehearsal: GpuRehearsal | None = None
    ) -> None:
        self.counter, self.rehearsal = counter, rehearsal
        self.events: list[tuple[str, str, int] | _Mark] = []
        self.start: dict[str, tuple[int, dict[str, int]]] = {}
        """Per device: the total and its labels when the step started."""

    def begin(self, when: str, totals: dict[str, int], by_label: dict[str, dict]) -> None:
        self.start = {device: (total, dict(by_label[device])) for device, total in totals.items()}
        self.phase(when)

    def phase(self, when: str) -> None:
        work = self.counter.work.plus(StepWork(), 0.0) if self.counter is not None else None
        report = (
            self.rehearsal.report.plus(RehearsalReport(), 0.0)
            if self.rehearsal is not None
            else None
        )
        self.events.append(_Mark(when, work, report))

    def end(self) -> None:
        """The step is over: the counts at its end close the last phase."""
        self.phase("")


@dataclass
class _Period:
    """Consecutive phases of one unit's forward or backward (or one phase outside the blocks)."""

    key: tuple[str, int] | None
    phases: list[tuple[str, list[tuple[str, str, int]]]] = field(default_factory=list)
    first: _Mark | None = None
    last: _Mark | None = None
    """The marks that open it and the next period."""


def _periods(timeline: StepTimeline, reduction: DepthReduction) -> list[_Period]:
    periods: list[_Period] = []
    for item in timeline.events:
        if isinstance(item, _Mark):
            if periods:
                periods[-1].last = item
            if not item.when:  # the end
                break
            key = reduction.period_of(item.when)
            if not periods or key is None or periods[-1].key != key:
                periods.append(_Period(key, first=item))
            periods[-1].phases.append((item.when, []))
        else:
            periods[-1].phases[-1][1].append(item)
    return periods


@dataclass
class _Device:
    """One device's running total, its labels and its peak, as the tracker keeps them."""

    total: int = 0
    labels: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    peak: Peak = field(default_factory=Peak)


@dataclass
class Expanded:
    """The planned step's peaks, counted work and rehearsal."""

    peaks: dict[str, Peak]
    work: StepWork | None
    report: RehearsalReport | None


def _play(devices: dict[str, _Device], period: _Period, times: int, name) -> None:
    """Play ``period`` ``times`` times in a row; ``name(when, copy)``: its marks' words."""
    net: dict[str, int] = defaultdict(int)
    net_labels: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    label_highs: dict[str, dict[str, int]] = defaultdict(dict)
    best: dict[str, tuple[int, str, dict[str, int]]] = {}
    for when, events in period.phases:
        for device, label, nbytes in events:
            net[device] += nbytes
            net_labels[device][label] += nbytes
            highs = label_highs[device]
            highs[label] = max(highs.get(label, 0), net_labels[device][label])
            if device not in best or net[device] > best[device][0]:
                best[device] = (net[device], when, dict(net_labels[device]))
    for device, highs in label_highs.items():
        state = devices.setdefault(device, _Device())
        for label, high in highs.items():
            growth = net_labels[device][label]
            top = state.labels[label] + (times - 1) * max(growth, 0) + high
            state.peak.label_highs[label] = max(state.peak.label_highs.get(label, 0), top)
    for device, (high, when, labels_then) in best.items():
        state = devices.setdefault(device, _Device())
        copy = times - 1 if net[device] > 0 else 0  # the highest copy (module docstring)
        candidate = state.total + copy * net[device] + high
        if candidate > state.peak.bytes:
            labels = dict(state.labels)
            for label, nbytes in net_labels[device].items():
                labels[label] = labels.get(label, 0) + copy * nbytes
            for label, nbytes in labels_then.items():
                labels[label] = labels.get(label, 0) + nbytes
            state.peak = Peak(candidate, name(when, copy), labels, state.peak.label_highs)
        state.total += times * net[device]
        for label, nbytes in net_labels[device].items():
            state.labels[label] += times * nbytes


def expand(timeline: StepTimeline, reduction: DepthReduction) -> Expanded:
    """The full-depth step of ``reduction`` from the traced step's ``timeline`` (module
    docstring)."""
    devices: dict[str, _Device] = {}
    periods = _periods(timeline, reduction)
    first_when = reduction.rename(periods[0].phases[0][0]) if periods else ""
    for device, (total, labels) in timeline.start.items():
        devices[device] = _Device(
            total, defaultdict(int, labels), Peak(total, first_when, labels, dict(labels))
        )
    end = timeline.events[-1]
    work, report = end.work, end.report
    for period in periods:
        _play(devices, period, 1, lambda when, _copy: reduction.rename(when))
        copies = reduction.copies.get(period.key, 0) if period.key is not None else 0
        if not copies:
            continue
        phase = period.key[0]
        _play(devices, period, copies, lambda when, copy, p=phase: reduction.rename(when, p, copy))
        if work is not None:
            work = work.plus(period.last.work.plus(period.first.work, -1.0), copies)
        if report is not None:
            report = report.plus(period.last.report.plus(period.first.report, -1.0), copies)
    return Expanded({d: state.peak for d, state in devices.items()}, work, report)
