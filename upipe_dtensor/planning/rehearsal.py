"""The traced step as a GPU rehearsal: what a CUDA job of the planned config would make its host
wait for, and on which device type each of its collectives runs.

The planner's step runs on fake CPU tensors standing for the GPU and fake ``meta`` tensors for
host memory (``planning.step``). During the measured step (forward, backward, gradient clipping;
not the optimizer step, whose CPU kernels are not the GPU's fused AdamW) this records:

- host syncs, each with the op and the call site that caused it: a device value read on the host
  (``.item()``, ``.tolist()``, ``bool()``, ``int()``, ``float()``), a blocking copy between host
  and device, a ``non_blocking`` copy whose host side is pageable (CUDA stages it through a
  bounce buffer and the host waits), host data copied to the device by a factory
  (``torch.tensor(list, device=cuda)``), and FSDP2's wait for offloaded gradients (below);
- every collective by kind and by the device type its tensors have in the CUDA job, which the
  planner checks against the process-group backend (``runtime.process_group``).

Where a tensor lives in the CUDA job: a fake ``meta`` tensor on the host; a fake CPU tensor on
the GPU, unless it is one FSDP2 keeps on the host under CPU offload. Two rules make the fake step
place tensors as the CUDA job does:

- a factory called without a device (``torch.arange(n)``, ``torch.tensor(list)``) makes a host
  tensor on CUDA, so here it makes a ``meta`` one (copying it to the device is then a host copy
  the rehearsal sees);
- with ``CPUOffloadPolicy`` FSDP2 keeps each sharded parameter and its gradient in (pinned) host
  memory and writes ``torch.device("cpu")``, which on the planner's CPU stand-in moves nothing.
  So those tensors are marked as host tensors (``hold_on_host``; gradients as FSDP2 assigns
  them, through its post-accumulate-grad hooks) and every tensor computed from them is a host
  tensor too, except FSDP2's all-gather buffers (``fsdp.all_gather_copy_in``), into which the
  CUDA job copies the shards asynchronously from pinned memory. FSDP2 copies the gradients back
  asynchronously into pinned memory and waits on the host for those copies once per backward
  (``FSDPParamGroup.finalize_backward``): one sync per backward that delivers offloaded
  gradients, counted here as FSDP2's code does it on CUDA.

The copies of the project's one device-runtime seam (``runtime.host_store``) are non_blocking from
pinned memory on CUDA; rehearsing, the seam makes the same calls on its stand-ins and marks their
buffers as pinned (``modes.rehearsal``), so a blocking or pageable copy there is seen too.

What it cannot see: CUDA calls that have no fake equivalent (``torch.cuda.synchronize``, event and
stream waits; the project's step makes none outside FSDP2's, which is counted), syncs inside
compiled kernels or third-party C++ (an op with a data-dependent output shape, such as
``nonzero`` on a device tensor, stops the fake step with an error instead of being counted), the
optimizer step, and what ``Trainer.train`` does between steps (it reads the loss and the gradient
norm for its log line and agrees on stop requests: a few reads per step, by design).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import PurePath

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from upipe_dtensor.modes.loops import repeats
from upipe_dtensor.modes.rehearsal import compiled_calls_inside, rehearsing
from upipe_dtensor.planning.step_work import add_counts
from upipe_dtensor.planning.tracker import run_op_bodies, tensor_leaves
from upipe_dtensor.runtime import host_store
from upipe_dtensor.runtime.torch_private import (
    DataDependentOutputException,
    TorchDispatchMode,
    TorchDispatchModeKey,
    current_graph_task_id,
    device_constructors,
    engine_run_backward,
    get_dispatch_mode,
    is_fake,
    is_torch_function_mode_enabled,
    pop_torch_function_mode,
    push_torch_function_mode,
)

_READS = {
    Tensor.item: ".item()",
    Tensor.tolist: ".tolist()",
    Tensor.__bool__: "bool()",
    Tensor.__int__: "int()",
    Tensor.__float__: "float()",
    Tensor.__index__: "index()",
}
"""Tensor methods that hand a device value to Python: the host waits for the device."""
_DATA_FACTORIES = (torch.tensor, torch.as_tensor, torch.asarray)
_COLLECTIVES = {
    # c10d (torch.distributed's eager API) and _c10d_functional (DTensor, functional API)
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "send": "p2p",
    "recv_": "p2p",
    "barrier": "barrier",
}
FSDP_OFFLOAD_WAIT = (
    "FSDP2 CPU offload: the host waits for the gradients' device-to-host copies",
    "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py (finalize_backward)",
)
_SKIPPED_FRAMES = (
    "upipe_dtensor/planning/rehearsal.py",
    "torch/utils/_python_dispatch.py",
    "torch/overrides.py",
    "torch/_tensor.py",
    "torch/utils/_device.py",
    "torch/_ops.py",
    "torch/_subclasses/",
    "torch/_compile.py",
    "torch/_dynamo/",
)


def call_site() -> str:
    """``path:line (function)`` of the innermost frame of this project (else of anything but the
    dispatch machinery) that is running now."""
    frame, fallback = sys._getframe(1), ""
    while frame is not None:
        path = PurePath(frame.f_code.co_filename).as_posix()
        if not any(skip in path for skip in _SKIPPED_FRAMES):
            where = _short(path)
            site = f"{where}:{frame.f_lineno} ({frame.f_code.co_name})"
            if where.startswith("upipe_dtensor/"):
                return site
            fallback = fallback or site
        frame = frame.f_back
    return fallback


def _short(path: str) -> str:
    for root in ("upipe_dtensor/", "torch/", "torchtitan/"):
        index = path.rfind(f"/{root}")
        if index >= 0:
            return path[index + 1 :]
    return path


def _tensors(tree) -> Iterator[Tensor]:
    for leaf in tensor_leaves(tree):
        if isinstance(leaf, DTensor):
            yield leaf._local_tensor
        elif isinstance(leaf, Tensor):
            yield leaf


@dataclass
class RehearsalReport:
    """What one rehearsed step asks of a CUDA job (module docstring)."""

    host_syncs: dict[tuple[str, str], float] = field(default_factory=dict)
    """(what, call site) -> times per step."""
    collectives: dict[tuple[str, str], float] = field(default_factory=dict)
    """(kind, device type in the CUDA job) -> calls per step."""
    collective_sites: dict[tuple[str, str], str] = field(default_factory=dict)
    """(kind, device type) -> the call site of its first call."""

    def plus(self, other: RehearsalReport, times: float = 1.0) -> RehearsalReport:
        """A new report: this one's calls plus ``times`` x ``other``'s (first call sites:
        this one's, else ``other``'s)."""
        return RehearsalReport(
            host_syncs=add_counts(self.host_syncs, other.host_syncs, times),
            collectives=add_counts(self.collectives, other.collectives, times),
            collective_sites={**other.collective_sites, **self.collective_sites},
        )

    @property
    def host_syncs_per_step(self) -> int:
        return round(sum(self.host_syncs.values()))

    def sync_rows(self) -> list[dict]:
        """The syncs, most frequent first, as JSON rows."""
        rows = sorted(self.host_syncs.items(), key=lambda kv: (-kv[1], kv[0]))
        return [{"what": what, "site": site, "count": round(n)} for (what, site), n in rows]

    def collective_counts(self) -> dict[str, int]:
        """``"all_reduce on cpu"`` -> calls per step."""
        return {
            f"{kind} on {device}": round(calls)
            for (kind, device), calls in sorted(self.collectives.items())
        }


class GpuRehearsal:
    """Records a ``RehearsalReport`` of the traced step; see the module docstring.

    ``device`` and ``host`` are the planner's stand-ins (fake CPU and ``meta``), ``device_type``
    the device type of the job rehearsed. Enter ``ops()`` right inside the planner's
    ``FakeTensorMode`` and ``step()`` around the step; it counts while ``counting``.
    """

    def __init__(self, device: torch.device, host: torch.device, device_type: str = "cuda"):
        self.device, self.host, self.device_type = device, host, device_type
        self.report = RehearsalReport()
        self.counting = False
        self._host_storages: dict[int, weakref.ref] = {}
        self._offload_waits: set[int] = set()
        self._dispatch = _Dispatch(self)
        self._functions = _Functions(self)

    # -- where a tensor lives in the CUDA job --------------------------------------------------

    def on_host(self, tensor: Tensor) -> bool:
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        if tensor.device.type != self.device.type or not is_fake(tensor):
            return True  # the host stand-in, or real data the planner holds on the host
        return self._is_held(tensor)

    def _is_held(self, tensor: Tensor) -> bool:
        storage = tensor.untyped_storage()
        ref = self._host_storages.get(id(storage))
        return ref is not None and ref() is storage

    def hold_on_host(self, tensors: Iterable[Tensor]) -> None:
        """Mark ``tensors`` (fake CPU ones) as host tensors of the CUDA job (FSDP2 CPU offload)."""
        for tensor in _tensors(list(tensors)):
            if tensor.device.type == self.device.type and not self._is_held(tensor):
                storage = tensor.untyped_storage()
                key = id(storage)
                self._host_storages[key] = weakref.ref(
                    storage, lambda _ref, key=key: self._host_storages.pop(key, None)
                )

    def hold_offloaded_state(self, model: torch.nn.Module) -> None:
        """FSDP2 CPU offload: every sharded parameter, and each gradient FSDP2 assigns (its
        post-accumulate-grad hooks run right after), is a host tensor; a backward that delivers
        them ends with FSDP2's host wait for their copies."""

        def gradient_arrived(param: Tensor) -> None:
            self.hold_on_host([param.grad])
            task = current_graph_task_id()
            if self.counting and task not in self._offload_waits:
                self._offload_waits.add(task)
                self._sync(*FSDP_OFFLOAD_WAIT)

        params = list(model.parameters())
        self.hold_on_host(params)
        for param in params:
            param.register_post_accumulate_grad_hook(gradient_arrived)

    def outside_compiled_blocks(self, model: torch.nn.Module) -> None:
        """Run each compiled block with this rehearsal's torch-function mode off: dynamo traces
        the torch-function modes it finds into the graph it compiles (and cannot trace this
        one), while the dispatch mode steps aside as the tracker does. What a compiled block
        reads or copies on the host is then not seen (docs/gpu.md lists it); the compiled tile
        kernels, and the regions of blocks compiled as two (``memory.compiled_regions``, torch
        2.11), are run the same way (``step``)."""
        for block in model.layers.values():
            inner = getattr(block, "_checkpoint_wrapped_module", block)
            compiled = getattr(inner, "_compiled_call_impl", None)
            if compiled is not None:
                inner._compiled_call_impl = functools.partial(self._functions_off_for, compiled)

    def _functions_off_for(self, call, *args, **kwargs):
        with self.functions_off():
            return call(*args, **kwargs)

    @contextlib.contextmanager
    def functions_off(self) -> Iterator[None]:
        """This rehearsal's torch-function mode (and the modes above it) off for a while."""
        popped = []
        while is_torch_function_mode_enabled():
            popped.append(pop_torch_function_mode())
            if popped[-1] is self._functions:
                break
        else:  # not on the stack: nothing to take off
            for mode in reversed(popped):
                push_torch_function_mode(mode)
            popped = []
        try:
            yield
        finally:
            for mode in reversed(popped):
                push_torch_function_mode(mode)

    # -- recording -----------------------------------------------------------------------------

    def _sync(self, what: str, site: str | None = None) -> None:
        key = (what, site or call_site())
        self.report.host_syncs[key] = self.report.host_syncs.get(key, 0.0) + repeats()

    def _collective(self, kind: str, args) -> None:
        devices = {"cpu" if self.on_host(t) else self.device_type for t in _tensors(args)}
        for device in devices or {self.device_type}:
            key = (kind, device)
            self.report.collectives[key] = self.report.collectives.get(key, 0.0) + repeats()
            self.report.collective_sites.setdefault(key, call_site())

    def _copy(self, name: str, args, kwargs, out) -> None:
        if name == "copy_":
            target, source = args[0], args[1]
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
        else:
            source, target = args[0], out
            non_blocking = kwargs.get("non_blocking", False)
        from_host, to_host = self.on_host(source), self.on_host(target)
        if from_host == to_host:
            return
        direction = "host-to-device" if from_host else "device-to-host"
        # A non_blocking ``.to(host)`` pins the copy it makes (``_to_copy``'s pinned output).
        if not non_blocking:
            self._sync(f"blocking {direction} copy")
        elif from_host and not host_store.is_pinned(source):
            self._sync(f"non_blocking {direction} copy from pageable host memory")
        elif name == "copy_" and to_host and not host_store.is_pinned(target):
            self._sync(f"non_blocking {direction} copy into pageable host memory")

    def _propagate(self, func, args, kwargs, out) -> None:
        """Tensors computed from host tensors are host tensors (FSDP2's all-gather buffers and
        in-place ops, whose outputs keep their place, aside)."""
        if func._schema.is_mutable or func.namespace == "fsdp":
            return
        if any(self._is_held(t) for t in _tensors((args, kwargs))):
            self.hold_on_host(t for t in _tensors(out) if is_fake(t))

    def ops(self) -> TorchDispatchMode:
        """The op-level watcher (copies, collectives, FSDP2's host tensors), entered right inside
        the planner's ``FakeTensorMode``, below its other modes: DTensor runs its local ops and
        the collectives its placements need (the gradient norm's all-reduce) in its own dispatch,
        which this mode is the only one to see (it hands DTensor ops on, so the modes above see
        them as DTensor ops, as without it)."""
        return self._dispatch

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The rehearsed step: factories without a device make host tensors, the host store
        copies as on CUDA, and device reads are recorded (while ``counting``)."""
        with (
            rehearsing(),
            compiled_calls_inside(self.functions_off),
            self._functions,
        ):
            yield


class _Dispatch(TorchDispatchMode):
    """Copies, collectives and FSDP2's host tensors, op by op."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while ``torch.compile`` compiles, on while its graphs run (as the tracker)."""
        return True

    def __init__(self, owner: GpuRehearsal) -> None:
        super().__init__()
        self.owner = owner

    def __enter__(self):
        run_op_bodies(_Dispatch)  # a compiled graph's project ops: their bodies' ops seen too
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if DTensor in types:  # DTensor's own dispatch runs its local ops, this mode still on
            return NotImplemented
        out = func(*args, **kwargs)
        owner = self.owner
        if owner._host_storages:
            owner._propagate(func, args, kwargs, out)
        if not owner.counting:
            return out
        name = func.overloadpacket.__name__
        if func.namespace in ("c10d", "_c10d_functional"):
            kind = _COLLECTIVES.get(name)
            if kind is not None:
                owner._collective(kind, args)
        elif name in ("_to_copy", "copy_"):
            owner._copy(name, args, kwargs, out)
        return out


def _stand_in_value(tensor: Tensor, read: str):
    """What a read of a fake tensor's value returns: zeros of its type (the fake step has no
    values; the read itself is what is counted)."""
    zero = False if tensor.dtype == torch.bool else 0.0 if tensor.is_floating_point() else 0
    return _nested(tuple(tensor.shape) if read == ".tolist()" else (), zero)


def _nested(shape: tuple[int, ...], value):
    if not shape:
        return value
    return [_nested(shape[1:], value) for _ in range(shape[0])]


class _Functions(TorchFunctionMode):
    """Factories' placement, device reads and host data copied to the device."""

    def __init__(self, owner: GpuRehearsal) -> None:
        super().__init__()
        self.owner = owner
        self._constructors = device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        if func is Tensor.backward:
            return self._backward(*args, **kwargs)
        faking = get_dispatch_mode(TorchDispatchModeKey.FAKE) is not None
        if faking and func in self._constructors:
            device = kwargs.get("device")
            from_tensor = func in _DATA_FACTORIES and args and isinstance(args[0], Tensor)
            if device is None and not from_tensor:
                kwargs = {**kwargs, "device": owner.host}  # as on CUDA: a host tensor
            elif (
                owner.counting
                and func in _DATA_FACTORIES
                and not from_tensor
                and torch.device(device).type == owner.device.type
            ):
                owner._sync(f"host data copied to the device ({func.__name__}(data, device=...))")
        read = _READS.get(func)
        if read is None or not (owner.counting and faking and not owner.on_host(args[0])):
            return func(*args, **kwargs)
        owner._sync(f"device value read on the host ({read})")
        try:
            return func(*args, **kwargs)
        except DataDependentOutputException:
            return _stand_in_value(args[0], read)

    def _backward(
        self, tensor: Tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None
    ):
        """``tensor.backward()`` with this mode on. A mode is off while it handles a call, so the
        backward pass (the checkpoints' recompute, the ops' backward) would otherwise run
        unobserved: the engine is started here, as ``torch.autograd.backward`` starts it."""
        gradient = torch.ones_like(tensor) if gradient is None else gradient
        with self:
            engine_run_backward(
                (tensor,),
                (gradient,),
                create_graph if retain_graph is None else retain_graph,
                create_graph,
                tuple(inputs or ()),
                allow_unreachable=True,
                accumulate_grad=True,
            )
