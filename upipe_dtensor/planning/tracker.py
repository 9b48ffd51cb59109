"""Live-tensor memory tracker: every storage allocated while it is active, by device and by what
allocated it, with the peak and what was alive at the peak.

A ``TorchDispatchMode`` sees each op's outputs; a storage is counted from the op that creates it
until it is freed (a weak-reference finaliser), so views and in-place ops cost nothing, exactly
as in a caching allocator without fragmentation. It works on real tensors and on fake ones (the
planner), and with ``modes.ops.transparent_ops()`` it also sees the buffers inside the
project's custom ops (the per-stage UPipe buffers are the point of UPipe).

Labels come from the Python call stack at allocation time: the attention, MLP and loss code of this
project, FSDP2's all-gather and reduce-scatter (model states), the optimizer, the activation
offload; allocations before ``start_step()`` are model states too (parameters, buffers, optimizer
state); the rest is "other", or "loss" inside the output head (final norm, projection, loss).

Under ``torch.compile`` the tracker is switched off while a graph compiles and on while it runs
(``ignore_compile_internals``), and a compiled graph's call of a project op runs the op's body
with the tracker on (``register_torch_dispatch``), so the buffers inside it count as in eager.
What inductor's generated code allocates itself does not dispatch: the planner's model of it is
``planning.compiled``.
"""

from __future__ import annotations

import contextlib
import sys
import types
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import PurePath

import torch

from upipe_dtensor.kernels.op_mode import project_ops
from upipe_dtensor.runtime.torch_private import TorchDispatchMode, is_traceable_wrapper_subclass

MODEL_STATES, ATTENTION, MLP, LOSS, OFFLOAD, OTHER = (
    "parameters + gradients + optimizer state",
    "attention",
    "mlp",
    "loss",
    "activation offload",
    "other",
)
NORMS = "rmsnorm outputs"
"""A block's normalised activations (the attention's and the MLP's inputs), kept while the block
that uses them runs."""
RESIDUAL = "residual stream"
"""A block's residual sums (x + attention, and the block output), e.g. the input of the next block
kept while a checkpoint group recomputes."""
GRADIENTS = "activation gradients"
"""Gradients autograd passes between ops (e.g. of a block's output and its residual stream),
allocated by torch's C++ autograd functions rather than by this project's code."""
EXPERTS = "mixture of experts"
"""An MoE block's own tensors: the router's scores and routing map, the tokens permuted to the
experts and back, the experts' hidden states (``memory.tiled_moe`` tiles them all)."""
FUSED = "compiled kernels"
"""Compiled blocks' fused kernel outputs: residual sums, fused norms (``planning.compiled``)."""

_MOE_SOURCES = (
    "upipe_dtensor/memory/tiled_moe.py",
    "upipe_dtensor/memory/grouped_swiglu.py",
    "torchtitan/models/common/moe.py",
    "torchtitan/models/common/token_dispatcher.py",
)
# (path suffix, function name or None for any) -> label; the innermost matching frame wins.
# Checkpoint recompute is triggered from inside whichever backward first needs a saved tensor:
# the walk stops there, so a recomputed block is not charged to that backward.
_STOP = "stop"
_RULES: tuple[tuple[str, str | None, str], ...] = (
    ("torch/utils/checkpoint.py", "recompute_fn", _STOP),
    ("upipe_dtensor/parallel/", None, ATTENTION),  # every CP style, its ops, ring and exchanges
    ("upipe_dtensor/memory/tiled_mlp.py", None, MLP),
    *((path, None, EXPERTS) for path in _MOE_SOURCES),
    ("torchtitan/models/llama3/model/model.py", "forward", None),  # resolved by qualname below
    ("upipe_dtensor/memory/chunked_loss.py", None, LOSS),
    ("upipe_dtensor/memory/rms_norm.py", None, NORMS),
    ("torch/nn/functional.py", "rms_norm", NORMS),
    ("torch/nn/functional.py", "cross_entropy", LOSS),
    # Copies made by the shared host store count for whoever asked: the activation offload here,
    # the attention for FPDT's K/V chunks (matched by the attention rules above).
    *(("upipe_dtensor/memory/offload.py", name, OFFLOAD) for name in ("pack", "unpack")),
    ("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", None, MODEL_STATES),
    ("torch/distributed/fsdp/_fully_shard/_fsdp_param.py", None, MODEL_STATES),
    ("torch/optim/", None, MODEL_STATES),
    ("upipe_dtensor/planning/compiled.py", "launch", FUSED),
    # Innermost Python frame of a C++ autograd function's allocation (our own backward code is
    # matched by the rules above first).
    ("torch/autograd/graph.py", "_engine_run_backward", GRADIENTS),
)
_TITAN_FORWARDS = {
    "FeedForward.forward": MLP,
    "Attention.forward": ATTENTION,
    "TransformerBlock.forward": RESIDUAL,
}


_PASS = "pass"  # no rule decides at this frame: look at its caller
_FRAME_LABELS: dict[types.CodeType, str] = {}  # a frame's outcome depends on its code only


def _frame_label(code: types.CodeType) -> str:
    """The rules' verdict for a frame running ``code``: a label, ``_STOP`` or ``_PASS``."""
    path = PurePath(code.co_filename).as_posix()
    for suffix, function, label in _RULES:
        if (suffix in path) and (function is None or code.co_name == function):
            if label is None:
                return _TITAN_FORWARDS.get(code.co_qualname, _PASS)
            return label
    return _PASS


def label_from_stack() -> str | None:
    """The label of whoever is allocating now: the innermost frame a rule decides (None: stop, or
    no rule matched). Frames of the tracker itself match no rule, so any caller may ask."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        label = _FRAME_LABELS.get(code)
        if label is None:
            label = _FRAME_LABELS[code] = _frame_label(code)
        if label != _PASS:
            return None if label == _STOP else label
        frame = frame.f_back
    return None


def tensor_leaves(tree) -> list[torch.Tensor]:
    """The tensors of an op's arguments or outputs (nested in tuples, lists and dicts), in
    ``tree_flatten``'s order: the dispatch modes walk every op's, and this plain walk costs a
    fraction of pytree's general one. (No recursive closure: a reference cycle would keep the
    tensors alive until the garbage collector runs, and the tracker counts when they die.)"""
    found: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            found.append(node)
        elif isinstance(node, (tuple, list)):
            stack.extend(reversed(node))
        elif isinstance(node, dict):
            stack.extend(reversed(node.values()))
    return found


_quiet = False


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """Ops run here are neither tracked nor counted (``StepWorkCounter``): the planner works out
    shapes of values a compiled kernel never stores (``planning.compiled``)."""
    global _quiet
    previous, _quiet = _quiet, True
    try:
        yield
    finally:
        _quiet = previous


def is_untracked() -> bool:
    return _quiet


def run_op_bodies(mode_type: type[TorchDispatchMode]) -> None:
    """Make ``mode_type`` run each project op's body with itself re-entered, so that it sees the
    ops inside (a compiled graph calls the op itself: ``kernels.op_mode.call`` cannot switch)."""
    for spec in project_ops().values():
        if mode_type not in spec.op._torch_dispatch_fns:

            def rule(mode, func, types, args, kwargs, body=spec.body):
                with mode:
                    return body(*args, **kwargs)

            spec.op.register_torch_dispatch(mode_type, rule)


@dataclass
class Recording:
    """What a tracker counted inside ``LiveMemoryTracker.recording()``, in order."""

    events: list[tuple[str, str, int]] = field(default_factory=list)
    """Every (device, label, bytes) change: allocations positive, frees negative."""
    allocated: dict[int, weakref.ref] = field(default_factory=dict)
    """The storages allocated, by id."""
    before: list[weakref.ref] = field(default_factory=list)
    """The storages tracked when it began."""


@dataclass
class Peak:
    """The largest total on one device, when it happened, and what was alive then by label."""

    bytes: int = 0
    when: str = ""
    by_label: dict[str, int] = field(default_factory=dict)
    label_highs: dict[str, int] = field(default_factory=dict)
    """Each label's own largest live bytes during the step, whenever it was (an MoE block's
    buffers peak inside the block, not at the step's peak)."""


def _holding_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose storages hold ``tensor``'s bytes: a wrapper subclass (a DTensor, the
    ``AsyncCollectiveTensor`` an eager functional collective returns) allocates nothing of its
    own, its inner tensors do (counting the wrapper too counted a collective's output twice)."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]
    return [held for t in inner if isinstance(t, torch.Tensor) for held in _holding_tensors(t)]


class LiveMemoryTracker(TorchDispatchMode):
    """Counts live storage bytes per device and label; see the module docstring."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self.totals: dict[str, int] = defaultdict(int)
        self.by_label: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.peaks: dict[str, Peak] = defaultdict(Peak)
        self.timeline = None
        """A ``planning.timeline.StepTimeline`` to record the step into (allocations, frees and
        the phases of ``when``), or None."""
        self._when = "setup"
        self.in_head = False
        self._setup = True
        self._live: dict[
            int, tuple[weakref.ref, list]
        ] = {}  # id -> (storage ref, [device, label, bytes])
        self._original_resize = torch.UntypedStorage.resize_
        self._depth = 0
        self._recording: Recording | None = None

    # -- phase bookkeeping (set by the planner and by module hooks) ----------------------------

    @property
    def when(self) -> str:
        """Where in the step it is, in words ("forward, block 3")."""
        return self._when

    @when.setter
    def when(self, value: str) -> None:
        if value != self._when and self.timeline is not None and not self._setup:
            self.timeline.phase(value)
        self._when = value

    def start_step(self) -> None:
        """From now on allocations are the step's (not model states by default); peaks restart
        from the current totals."""
        self._setup = False
        for device, total in self.totals.items():
            labels = dict(self.by_label[device])
            self.peaks[device] = Peak(total, self.when, labels, dict(labels))
        if self.timeline is not None:
            self.timeline.begin(self.when, self.totals, self.by_label)

    def _label(self) -> str:
        if self._setup:
            return MODEL_STATES
        label = label_from_stack()
        if label is None:
            label = LOSS if self.in_head else OTHER
        return label

    # -- tracking ------------------------------------------------------------------------------

    def _add(self, device: str, label: str, nbytes: int) -> None:
        if self.timeline is not None and not self._setup:
            self.timeline.events.append((device, label, nbytes))
        if self._recording is not None:
            self._recording.events.append((device, label, nbytes))
        self.totals[device] += nbytes
        self.by_label[device][label] += nbytes
        peak = self.peaks[device]
        if self.by_label[device][label] > peak.label_highs.get(label, 0):
            peak.label_highs[label] = self.by_label[device][label]
        if self.totals[device] > peak.bytes:
            peak.bytes, peak.when = self.totals[device], self.when
            peak.by_label = dict(self.by_label[device])

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        known = self._live.get(key)
        if known is not None and known[0]() is storage:
            return
        record = [str(tensor.device), self._label(), storage.nbytes()]
        self._register(storage, record)
        self._add(*record)

    def _register(self, storage: torch.UntypedStorage, record: list) -> None:
        """Count ``record``'s bytes off again when ``storage`` is freed."""
        key = id(storage)
        if self._recording is not None:
            self._recording.allocated[key] = weakref.ref(storage)

        def release(_ref, key=key, record=record) -> None:
            self._live.pop(key, None)
            self._add(record[0], record[1], -record[2])

        self._live[key] = (weakref.ref(storage, release), record)

    def count(self, device: str, label: str, nbytes: int) -> None:
        """Count ``nbytes`` as allocated now that no tensor of this process holds: the states of
        the blocks a reduced-depth plan does not trace (``planning.depth``)."""
        self._add(device, label, nbytes)

    def stand_for(self, tensor: torch.Tensor, copies: int) -> None:
        """``tensor``'s storage stands for ``copies`` more of its size, allocated where this
        process allocated none (the inserted periods of ``planning.timeline``): they are freed
        with it (a storage ``resize_`` never changes, as gradients)."""
        storage = tensor.untyped_storage()
        known = self._live.get(id(storage))
        if known is None or known[0]() is not storage:
            raise ValueError("stand_for: the storage is not tracked")
        known[1][2] += copies * storage.nbytes()

    def record_of(self, tensor: torch.Tensor) -> tuple[str, str, int] | None:
        """(device, label, bytes) of the tracked storage ``tensor`` lives in, or None."""
        storage = tensor.untyped_storage()
        known = self._live.get(id(storage))
        if known is None or known[0]() is not storage:
            return None
        device, label, nbytes = known[1]
        return device, label, nbytes

    def is_tracked(self, key: int, storage: weakref.ref) -> bool:
        """Whether the storage of id ``key`` (``storage`` refers to it) is tracked now."""
        known = self._live.get(key)
        return known is not None and known[0]() is storage() is not None

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recording]:
        """Counted as always, and recorded: what ``planning.replay`` plays again with ``play``
        and ``adopt``."""
        recording = Recording(before=[ref for ref, _ in self._live.values()])
        previous, self._recording = self._recording, recording
        try:
            yield recording
        finally:
            self._recording = previous

    def play(self, events: list[tuple[str, str, int]] | tuple[tuple[str, str, int], ...]) -> None:
        """Count a recording's changes again, in order, as if their tensors came and went."""
        for device, label, nbytes in events:
            self._add(device, label, nbytes)

    def adopt(self, tensor: torch.Tensor, record: tuple[str, str, int]) -> None:
        """Track ``tensor``'s storage as ``record`` (already counted by ``play``): its bytes go
        when it is freed."""
        self._register(tensor.untyped_storage(), list(record))

    def _resize(self, storage: torch.UntypedStorage, size: int):
        """FSDP2 frees and re-grows its all-gather buffers with ``resize_``, which no dispatch
        mode sees (PyTorch's own MemTracker patches it the same way)."""
        out = self._original_resize(storage, size)
        known = self._live.get(id(storage))
        if known is not None and known[0]() is storage:
            record = known[1]
            self._add(record[0], record[1], size - record[2])
            record[2] = size
        return out

    def __enter__(self):
        tracker = self
        if not self._depth:  # re-entered by ``run_op_bodies``: patched once
            run_op_bodies(LiveMemoryTracker)
            torch.UntypedStorage.resize_ = lambda storage, size: tracker._resize(storage, size)
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if not self._depth:
            torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _quiet:
            return out
        for leaf in tensor_leaves(out):
            for held in _holding_tensors(leaf):
                if held.layout == torch.strided:
                    self._track(held)
        return out
