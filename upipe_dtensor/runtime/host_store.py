"""Host memory for device tensors: park a tensor in (pinned) host memory, fetch it back later.

Shared by the activation offload (block inputs parked during forward, fetched in backward) and by
FPDT's chunk offload (earlier K/V chunks parked, fetched one at a time). On CUDA the copies run on
side streams into pinned buffers pooled by shape (pinned at their exact size), and a fetch can be
started early (``prefetch``) so it overlaps compute; ``retrieve`` then only waits for it. On CPU
the same code runs with plain copies. ``host_device`` may be a stand-in (the memory planner uses
``meta``), so host memory is counted apart from device memory; ``host_bytes`` /
``peak_host_bytes`` report what the pool holds. ``to_device`` sends a step's small host inputs
(token shards, positions, cu_seqlens) the same way: pinned, non_blocking.

This module is the project's one device-runtime seam: every stream, event and pinned-memory call
is here, on documented ``torch.cuda`` APIs, and nothing else in the package needs a GPU to run.
The rules it keeps (untraced: fake tensors have no streams): a tensor fetched back is allocated
on the compute stream, so the caching allocator can reuse its memory there, and filled on the side
stream (``record_stream`` keeps it alive for that stream); the compute stream, never the CPU, waits
for each copy's event; a host buffer goes back to the pool at once, and the side stream that
writes it next waits on the device for the copies that last read it: the host never waits.
The planner rehearses a CUDA job through the same calls (``modes.rehearsal``): its copies carry the
CUDA branch's ``non_blocking`` flag and its stand-in buffers count as pinned.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from upipe_dtensor.modes.rehearsal import is_rehearsing
from upipe_dtensor.runtime.torch_private import is_fake

_PINNED_STAND_INS: dict[int, weakref.ref] = {}
"""Host stand-ins (fake or ``meta`` tensors' storages) that play pinned buffers while the planner
rehearses a CUDA job."""


def _mark_pinned(tensor: Tensor) -> None:
    storage = tensor.untyped_storage()
    key = id(storage)
    _PINNED_STAND_INS[key] = weakref.ref(
        storage, lambda _ref, key=key: _PINNED_STAND_INS.pop(key, None)
    )


def is_pinned(tensor: Tensor) -> bool:
    """Whether ``tensor`` is page-locked host memory (a rehearsal's stand-in: marked so here)."""
    if is_fake(tensor) or tensor.device.type == "meta":
        storage = tensor.untyped_storage()
        ref = _PINNED_STAND_INS.get(id(storage))
        return ref is not None and ref() is storage
    return tensor.device.type == "cpu" and tensor.is_pinned()


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device`` without the host waiting for the copy: on CUDA from pinned
    memory with ``non_blocking`` (torch's pinned allocator keeps the staged block until the copy
    has run, so it may be dropped at once); a plain copy elsewhere. Per-step inputs and metadata
    (token shards, positions, cu_seqlens) go to the device this way."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    if is_rehearsing():  # the CUDA branch on stand-ins: a pinned copy, then an async one
        staged = tensor.clone()
        _mark_pinned(staged)
        return staged.to(device, non_blocking=True)
    return tensor.to(device)


def _pinned_empty(shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """Page-locked host memory of exactly ``shape``. torch's pinned allocator rounds every
    allocation up to a power of two (``torch.cuda.memory.host_memory_stats``): a 5 GiB block input
    would take 8 GiB, 250 GiB per GPU at 5M tokens. So plain host memory is registered with CUDA
    (``cudaHostRegister``) instead, which pins exactly what is asked for; ``HostStore.free``
    unregisters it."""
    buffer = torch.empty(shape, dtype=dtype)
    if buffer.nbytes:
        try:
            torch.cuda.check_error(
                torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0)
            )
        except RuntimeError as err:
            raise RuntimeError(
                f"pinning {buffer.nbytes / 2**30:.2f} GiB of host memory for the offload failed "
                f"({err}); check the locked-memory limit (ulimit -l) and the host RAM free"
            ) from err
    return buffer


def _unpin(buffers: list[Tensor], device: torch.device) -> None:
    """Unregister a store's pinned buffers once every copy into or out of them has run (their
    memory is freed when the last tensor viewing it goes)."""
    if not buffers:
        return
    torch.cuda.synchronize(device)
    for buffer in buffers:
        if buffer.nbytes:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
    buffers.clear()


@dataclass
class Parked:
    """One tensor living in host memory, and its way back."""

    host: Tensor
    device: torch.device
    copied_to_host: torch.cuda.Event | None
    on_device: Tensor | None = None
    copied_to_device: torch.cuda.Event | None = None
    last_read: torch.cuda.Event | None = None


class HostStore:
    """Parks tensors of ``device`` in ``host_device`` memory; see the module docstring."""

    def __init__(
        self, device: torch.device, host_device: torch.device = torch.device("cpu")
    ) -> None:
        self.device, self.host_device = device, host_device
        self.host_bytes = self.peak_host_bytes = 0
        self._pool: dict[tuple, list[tuple[Tensor, list[torch.cuda.Event]]]] = {}
        cuda = device.type == "cuda"
        self._to_host = torch.cuda.Stream(device) if cuda else None
        self._to_device = torch.cuda.Stream(device) if cuda else None
        self._pinned: list[Tensor] = []
        """Buffers registered with CUDA, unregistered when the store is freed or collected."""
        self._unpin = weakref.finalize(self, _unpin, self._pinned, device)
        self._unpin.atexit = False  # at exit the process's memory goes anyway

    def free(self) -> None:
        """Wait for this store's copies and give its pinned host memory back; nothing parked in
        it may be fetched afterwards (``gpu_check`` frees each backend's stores)."""
        self._pool.clear()
        self._unpin()

    def _host_buffer(self, like: Tensor) -> tuple[Tensor, list[torch.cuda.Event]]:
        """A host buffer for ``like`` and the copies that last used it (waited for on the
        device before it is written again, never by the host)."""
        free = self._pool.get((tuple(like.shape), like.dtype))
        if free:
            return free.pop(0)  # the oldest: its copies are the likeliest done
        if self.device.type == "cuda" and self.host_device.type == "cpu":
            buffer = _pinned_empty(like.shape, like.dtype)
            self._pinned.append(buffer)
        else:
            buffer = torch.empty(like.shape, dtype=like.dtype, device=self.host_device)
            if is_rehearsing():
                _mark_pinned(buffer)
        self.host_bytes += buffer.nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        return buffer, []

    def park(self, tensor: Tensor) -> Parked:
        """Copy ``tensor`` to a host buffer (CUDA: on a side stream, not waited for)."""
        host, last_copies = self._host_buffer(tensor)
        event = None
        if self._to_host is not None:
            self._to_host.wait_stream(torch.cuda.current_stream(self.device))
            for copy in last_copies:  # the buffer's last copy back must have read it
                self._to_host.wait_event(copy)
            with torch.cuda.stream(self._to_host):
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(self._to_host)  # keep its memory until the copy is done
                event = torch.cuda.Event()
                event.record()
        else:
            host.copy_(tensor, non_blocking=is_rehearsing())
        return Parked(host, tensor.device, event)

    def prefetch(self, parked: Parked) -> None:
        """Start (CUDA: asynchronously) the copy of ``parked`` back to the device."""
        if parked.on_device is not None:
            return
        if self._to_device is None:  # a real copy even on CPU: the host buffer may be reused
            parked.on_device = parked.host.to(
                parked.device, copy=True, non_blocking=is_rehearsing()
            )
            return
        compute = torch.cuda.current_stream(self.device)
        on_device = torch.empty_like(parked.host, device=parked.device)  # the compute stream's
        self._to_device.wait_stream(compute)  # the allocation is ordered on the compute stream
        with torch.cuda.stream(self._to_device):
            self._to_device.wait_event(parked.copied_to_host)
            on_device.copy_(parked.host, non_blocking=True)
            on_device.record_stream(self._to_device)
            parked.copied_to_device = torch.cuda.Event()
            parked.copied_to_device.record()
        parked.on_device = on_device

    def retrieve(self, parked: Parked, *, release: bool) -> Tensor:
        """The tensor back on the device (prefetched or copied now). ``release`` returns the host
        buffer to the pool; otherwise it stays parked and can be retrieved again."""
        self.prefetch(parked)
        tensor, parked.on_device = parked.on_device, None  # the caller owns it from here on
        if parked.copied_to_device is not None:
            torch.cuda.current_stream(self.device).wait_event(parked.copied_to_device)
            parked.last_read, parked.copied_to_device = parked.copied_to_device, None
        if release:
            self.release(parked)
        return tensor

    def release(self, parked: Parked) -> None:
        """Return the host buffer to the pool (the tensor is not needed again); the copies still
        running out of it are waited for on the device when the buffer is written again."""
        copies = [c for c in (parked.last_read, parked.copied_to_device) if c is not None]
        key = (tuple(parked.host.shape), parked.host.dtype)
        self._pool.setdefault(key, []).append((parked.host, copies))


class HostMemory:
    """One ``HostStore`` per device, registered under a name: custom ops take only tensors and
    plain values, so an op finds the host memory its style set up by that name."""

    _names = itertools.count()

    def __init__(self, host_device: torch.device = torch.device("cpu")) -> None:
        self.host_device = host_device
        self.stores: dict[torch.device, HostStore] = {}
        self.name = f"host-memory-{next(HostMemory._names)}"
        _NAMED[self.name] = self

    def store(self, device: torch.device) -> HostStore:
        if device not in self.stores:
            self.stores[device] = HostStore(device, self.host_device)
        return self.stores[device]

    def free(self) -> None:
        """Give back every store's pinned host memory (``HostStore.free``)."""
        for store in self.stores.values():
            store.free()


_NAMED: weakref.WeakValueDictionary[str, HostMemory] = weakref.WeakValueDictionary()


def named_host_store(name: str, device: torch.device) -> HostStore:
    """The store of the ``HostMemory`` called ``name`` for ``device``."""
    memory = _NAMED.get(name)
    if memory is None:
        raise ValueError(f"no host memory named {name!r}: the style that owned it is gone")
    return memory.store(device)
