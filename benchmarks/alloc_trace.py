"""Every thread's CPU allocations and frees, from an LD_PRELOAD library (``alloc_trace.c``): the
peer benchmark's measure of a layer's peak.

The contract is to count every byte the layer holds, whatever thread allocates or frees it.
torch.profiler's allocator events (``live_memory``) come only from threads where the profiler is
active: gloo's worker threads, which often drop the last reference to an all-to-all buffer, are
not, so those frees are missing (``live_memory.allocations`` puts them back by a rule). Asking
the profiler for every thread (``torch._C._profiler._ExperimentalConfig(profile_all_threads=
True)``) records no memory events at all. The trace sits below torch instead: its CPU allocator
takes buffers from ``posix_memalign`` and returns them with ``free``, and the library logs both,
with sizes, on every thread, in the order they happen.

Use: ``with preloaded(): ...`` (compiles the library with ``cc`` into a temporary folder once
per process and names it in ``LD_PRELOAD`` for the processes started inside); in such a process,
``with traced() as trace: ...`` records the calls inside, and ``peak(trace.records)`` is the
most bytes live at once above the level at the start.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

SOURCE = Path(__file__).with_name("alloc_trace.c")


class _Record(ctypes.Structure):
    _fields_ = [
        ("bytes", ctypes.c_int64),
        ("ptr", ctypes.c_uint64),
        ("tid", ctypes.c_uint32),
        ("aligned", ctypes.c_uint32),
    ]


@dataclass(frozen=True)
class Record:
    """One allocation (+bytes) or free (-bytes) at ``ptr``, on thread ``tid`` (the kernel's id,
    ``threading.get_native_id``); ``aligned``: the block came from posix_memalign, memalign or
    aligned_alloc (torch's CPU allocator), else from malloc, calloc or realloc."""

    bytes: int
    ptr: int
    tid: int
    aligned: bool


@dataclass
class Trace:
    """The records of one ``traced`` window, in order."""

    records: list[Record] = field(default_factory=list)


@functools.cache
def library() -> str:
    """The library's path, compiled from ``alloc_trace.c`` (once per process)."""
    path = os.path.join(tempfile.mkdtemp(prefix="alloc_trace_"), "alloc_trace.so")
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", path, str(SOURCE)], check=True)
    return path


@contextmanager
def preloaded() -> Iterator[None]:
    """Load the library into every process started inside the block (``LD_PRELOAD``); the
    processes started after it, e.g. other tests', run without it."""
    before = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = ":".join(p for p in (library(), before) if p)
    try:
        yield
    finally:
        if before is None:
            del os.environ["LD_PRELOAD"]
        else:
            os.environ["LD_PRELOAD"] = before


def _loaded() -> ctypes.CDLL:
    """The library this process was started with; RuntimeError when it was not preloaded
    (loaded later, it would not see the frees of blocks allocated before)."""
    handle = ctypes.CDLL(None)
    if not hasattr(handle, "alloc_trace_start"):
        raise RuntimeError("alloc_trace: start the process inside alloc_trace.preloaded()")
    handle.alloc_trace_position.restype = ctypes.c_uint64
    handle.alloc_trace_overflowed.restype = ctypes.c_uint64
    handle.alloc_trace_records.restype = ctypes.POINTER(_Record)
    return handle


@contextmanager
def traced() -> Iterator[Trace]:
    """Record every thread's allocations and frees inside the block."""
    lib, trace = _loaded(), Trace()
    lib.alloc_trace_start()
    try:
        yield trace
    finally:
        lib.alloc_trace_stop()
    if lib.alloc_trace_overflowed():
        raise RuntimeError("alloc_trace: the window has more records than the log holds")
    raw = lib.alloc_trace_records()
    trace.records = [
        Record(raw[i].bytes, raw[i].ptr, raw[i].tid, bool(raw[i].aligned))
        for i in range(lib.alloc_trace_position())
    ]


def peak(records: list[Record]) -> int:
    """The most bytes live at once above the level before the first record (frees of earlier
    blocks count: they lower the level)."""
    level = top = 0
    for record in records:
        level += record.bytes
        top = max(top, level)
    return top


def live_at_peak(records: list[Record]) -> list[tuple[int, Record]]:
    """(index, record) of the window's allocations live at its peak (its first one)."""
    level = top = 0
    live: dict[int, tuple[int, Record]] = {}
    at_peak: list[tuple[int, Record]] = []
    for index, record in enumerate(records):
        level += record.bytes
        if record.bytes > 0:
            live[record.ptr] = (index, record)
        else:
            live.pop(record.ptr, None)
        if level > top:
            top, at_peak = level, list(live.values())
    return at_peak
