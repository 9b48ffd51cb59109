"""Attention computations traced once per argument shapes and replayed: a plan's cost does not
grow with the attention calls of its traced blocks.

Every traced block runs the same attention op on arguments of the same shapes, in its forward,
in its checkpoint's recompute and in its backward, and on fake tensors the op's body always does
the same thing: the same buffers allocated and freed in the same order, the same kernels,
collectives and host copies. So ``ComputationReplay`` (installed by ``planning.step`` through
``modes.ops.computations_run_by``) runs an op's computation in full, records what
the live-tensor tracker, the step-work counter and the GPU rehearsal saw of it, and for a later
call on arguments alike (shapes, strides, dtypes, devices, which arguments share storage, plain
values, and the state of the counting) plays the record instead: the tracker's allocations and
frees in order (so the peak inside the call, its moment and what holds memory then are the
same), the counted work and rehearsed calls added, and outputs of the recorded shapes made
without ops and tracked as the recorded ones were.

A call is recorded only if it leaves nothing behind but its outputs: every storage it allocated
is freed by its end or is one of its outputs (fresh, contiguous, one storage each), and no
storage that existed before it was freed. The first call of a step usually is not: it fills the
host store's buffer pool and the head-index cache that later calls reuse. The kept attention
(``memory.kept_attention``) stays outside what is recorded, so a block that keeps its output, or
takes a kept one in its recompute, does so as in full. ``plan --full-trace`` runs every call in
full; ``tests/test_plan_depth.py`` compares the two.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from upipe_dtensor.modes.loops import repeats
from upipe_dtensor.planning.rehearsal import GpuRehearsal, RehearsalReport
from upipe_dtensor.planning.step_work import StepWork, StepWorkCounter
from upipe_dtensor.planning.tracker import LiveMemoryTracker, Recording, untracked


@dataclass(frozen=True)
class _Output:
    shape: tuple[int, ...]
    dtype: torch.dtype
    like: int
    """The argument whose device and type the output is made with (``new_empty``)."""
    record: tuple[str, str, int]
    """The tracker's (device, label, bytes) of its storage."""


@dataclass(frozen=True)
class _Recording:
    events: tuple[tuple[str, str, int], ...]
    work: StepWork
    report: RehearsalReport | None
    outputs: tuple[_Output, ...]


def _signature(args: tuple) -> tuple:
    """What a call's behaviour on fake tensors depends on, of its arguments."""
    storages: dict[int, int] = {}
    parts = []
    for arg in args:
        if isinstance(arg, Tensor):
            storage = arg.untyped_storage()
            parts.append(
                (
                    tuple(arg.shape),
                    arg.stride(),
                    arg.storage_offset(),
                    arg.dtype,
                    str(arg.device),
                    arg.requires_grad,
                    storages.setdefault(id(storage), len(storages)),
                    storage.nbytes(),
                )
            )
        else:
            parts.append(arg)
    return tuple(parts)


class ComputationReplay:
    """Runs attention computations for one traced step: in full, or replayed (module
    docstring)."""

    def __init__(
        self,
        tracker: LiveMemoryTracker,
        counter: StepWorkCounter,
        rehearsal: GpuRehearsal | None,
    ) -> None:
        self.tracker, self.counter, self.rehearsal = tracker, counter, rehearsal
        self._recordings: dict[tuple, _Recording] = {}

    def __call__(
        self, name: str, args: tuple, compute: Callable[[], tuple[Tensor, ...]]
    ) -> tuple[Tensor, ...]:
        key = (
            name,
            _signature(args),
            repeats(),
            torch.is_grad_enabled(),
            self.tracker.in_head,
            self.tracker.timeline is not None,
            self.counter.counting,
            self.rehearsal.counting if self.rehearsal is not None else None,
        )
        recording = self._recordings.get(key)
        if recording is not None:
            return self._play(recording, args)
        outputs, recording = self._record(args, compute)
        if recording is not None:
            self._recordings[key] = recording
        return outputs

    def _record(
        self, args: tuple, compute: Callable[[], tuple[Tensor, ...]]
    ) -> tuple[tuple[Tensor, ...], _Recording | None]:
        tracker = self.tracker
        work = self.counter.work.plus(StepWork(), 0.0)
        report = self.rehearsal.report.plus(RehearsalReport(), 0.0) if self.rehearsal else None
        with tracker.recording() as recorded:
            outputs = compute()
        made = self._outputs(args, outputs, recorded)
        alive = {key for key, ref in recorded.allocated.items() if tracker.is_tracked(key, ref)}
        clean = (
            made is not None
            and alive == {id(t.untyped_storage()) for t in outputs}
            and all(ref() is not None for ref in recorded.before)
            and sum(nbytes for _, _, nbytes in recorded.events) == sum(o.record[2] for o in made)
        )
        if not clean:
            return outputs, None
        return outputs, _Recording(
            events=tuple(recorded.events),
            work=self.counter.work.plus(work, -1.0),
            report=self.rehearsal.report.plus(report, -1.0) if self.rehearsal else None,
            outputs=made,
        )

    def _outputs(
        self, args: tuple, outputs: tuple[Tensor, ...], recorded: Recording
    ) -> tuple[_Output, ...] | None:
        """How to make ``outputs`` again, or None if they are not fresh contiguous tensors of
        their own storages, made by the call, on the device of one of its tensor arguments."""
        made = []
        seen: set[int] = set()
        for output in outputs:
            storage = output.untyped_storage()
            record = self.tracker.record_of(output)
            like = next(
                (
                    i
                    for i, arg in enumerate(args)
                    if isinstance(arg, Tensor) and arg.device == output.device
                ),
                None,
            )
            if (
                id(storage) in seen
                or id(storage) not in recorded.allocated
                or record is None
                or like is None
                or not output.is_contiguous()
                or output.storage_offset() != 0
                or storage.nbytes() != output.numel() * output.element_size()
            ):
                return None
            seen.add(id(storage))
            made.append(_Output(tuple(output.shape), output.dtype, like, record))
        return tuple(made)

    def _play(self, recording: _Recording, args: tuple) -> tuple[Tensor, ...]:
        self.tracker.play(recording.events)
        self.counter.work = self.counter.work.plus(recording.work)
        if self.rehearsal is not None:
            self.rehearsal.report = self.rehearsal.report.plus(recording.report)
        outputs = []
        with untracked():
            for output in recording.outputs:
                tensor = args[output.like].new_empty(output.shape, dtype=output.dtype)
                self.tracker.adopt(tensor, output.record)
                outputs.append(tensor)
        return tuple(outputs)
