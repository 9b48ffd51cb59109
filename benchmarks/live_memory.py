"""Live CPU memory from torch.profiler's allocator events, shared by the memory benchmarks.

A dispatch mode sees only an op's outputs, not the transient buffers inside custom ops (UPipe's
stage loop, the tiled MLP, the chunked loss). The profiler's allocator events
(``profile_memory=True``) record every CPU allocation and free, including those, so replaying
them in time order gives the peak of live bytes above the level at the start of a region. The
profiler misses frees made on gloo's worker thread; ``allocations`` puts them back.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._profiler import _EventType, _ProfilerEvent
from torch.profiler import ProfilerActivity, profile, record_function

from upipe_dtensor.runtime.errors import end_process

MiB = 2**20
# Ops that only allocate: an allocation is labelled by the op that called them instead.
_ALLOC_OPS = {
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::new_empty",
    "aten::zeros",
    "aten::zeros_like",
    "aten::new_empty_strided",
}
_AUTOGRAD_NODE = "autograd::engine::evaluate_function: "
# Python files whose frames label an allocation (the innermost one on its stack), and whose
# return puts back a free the profiler missed (``allocations``): this package's, torch's modules,
# the benchmarks', and the peers' (DeepSpeed's and yunchang's exchanges, whose buffers gloo's
# worker thread may let go of, so each is freed when its own function returns).
CODE_OF_INTEREST = re.compile(
    r"upipe_dtensor|torch/nn/modules|attention_memory|live_memory|peer_attention|deepspeed|yunchang"
)
_FRAME = re.compile(r"\(\d+\)")  # a PyCall's line number is its def line, not the call's: drop it
_CHECK = "live_memory::check"


@dataclass(frozen=True)
class Allocation:
    """One allocator event: +bytes on allocation, -bytes on free, with who allocated it."""

    time_ns: int
    nbytes: int
    ptr: int
    label: str


@dataclass
class RegionMemory:
    """Peak live bytes above the region's starting level, the level at its end, and who was live
    at the peak (bytes allocated inside the region, grouped by label)."""

    peak_bytes: int
    end_bytes: int
    live_at_peak: dict[str, int]


def _origin(event: _ProfilerEvent, code: re.Pattern[str]) -> tuple[str, int | None]:
    """Who made an allocation, as ``file function: aten op`` (the innermost Python frame in a file
    ``code`` matches, or the autograd node for backward ops that run without Python), and when
    that frame returned (None if there is no such frame)."""
    op, node = "?", event.parent
    while node is not None:
        if node.tag == _EventType.TorchOp:
            if node.name.startswith(_AUTOGRAD_NODE):
                return f"autograd {node.name[len(_AUTOGRAD_NODE) :]}: {op}", node.end_time_ns
            if op == "?" or op in _ALLOC_OPS:
                op = node.name
        elif node.tag == _EventType.PyCall and code.search(node.name):
            return f"{_FRAME.sub('', os.path.basename(node.name))}: {op}", node.end_time_ns
        node = node.parent
    return f"?: {op}", None


def allocations(
    prof: profile,
    alive: set[int],
    code: re.Pattern[str] = CODE_OF_INTEREST,
    put_back: bool = True,
) -> tuple[list[Allocation], int]:
    """Every CPU allocation and free in time order, with the frees the profiler missed put back
    (``put_back``; without: the events as recorded, the calling thread's accounting), each
    allocation labelled by the innermost frame of a file that ``code`` matches.

    The profiler records a free only on a thread where it is active. Gloo's worker thread
    sometimes drops the last reference to an all-to-all buffer (its work object holds them), so
    that free goes unrecorded and the buffer would look live forever. An allocation without a
    recorded free, whose address is reused or which is not in ``alive`` (storage pointers known to
    outlive the profile), is freed when the Python frame that made it returned (the program's
    last use) or at the reuse, whichever is first. Returns (events, number of frees put back).
    """
    raw: list[tuple[_ProfilerEvent, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            raw.append((event, event.extra_fields.alloc_size))
    raw.sort(key=lambda item: (item[0].start_time_ns, item[1]))

    found: list[Allocation] = []
    unfreed: dict[int, tuple[Allocation, int | None]] = {}
    missed: list[tuple[Allocation, int | None, int | None]] = []  # (allocation, frame end, reuse)
    for event, nbytes in raw:
        ptr, time_ns = event.extra_fields.ptr, event.start_time_ns
        if nbytes < 0:
            unfreed.pop(ptr, None)
            found.append(Allocation(time_ns, nbytes, ptr, ""))
            continue
        if ptr in unfreed:
            missed.append((*unfreed.pop(ptr), time_ns))
        label, frame_end = _origin(event, code)
        allocation = Allocation(time_ns, nbytes, ptr, label)
        unfreed[ptr] = (allocation, frame_end)
        found.append(allocation)
    if not put_back:
        return found, 0
    missed += [(a, end, None) for a, end in unfreed.values() if a.ptr not in alive]
    for allocation, frame_end, reuse in missed:
        times = [t for t in (frame_end, reuse) if t is not None]
        if not times:
            raise RuntimeError(f"no free recorded for {allocation}, and no way to place one")
        found.append(Allocation(min(times), -allocation.nbytes, allocation.ptr, ""))
    found.sort(key=lambda a: (a.time_ns, a.nbytes))
    return found, len(missed)


def split_events(events: list[Allocation], chosen) -> tuple[list[Allocation], list[Allocation]]:
    """(events of allocations whose label ``chosen`` accepts, the others), each free with its
    allocation: e.g. host buffers apart from device memory when both are CPU memory here."""
    picked: list[Allocation] = []
    rest: list[Allocation] = []
    live: dict[int, bool] = {}
    for event in events:
        if event.nbytes > 0:
            live[event.ptr] = chosen(event.label)
            (picked if live[event.ptr] else rest).append(event)
        else:  # a free without its allocation in the profile belongs to the (earlier) rest
            (picked if live.pop(event.ptr, False) else rest).append(event)
    return picked, rest


def region(prof: profile, name: str) -> tuple[int, int]:
    """[start, end] in ns of the outermost profiler range called ``name`` (an op or a
    ``record_function``); a custom op shows up once per dispatch level, all nested."""
    found: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.TorchOp and event.name == name:
            found.append((event.start_time_ns, event.end_time_ns))
        stack.extend(event.children)
    if not found:
        raise KeyError(f"no profiler range named {name!r}")
    return max(found, key=lambda span: span[1] - span[0])


def replay(
    events: list[Allocation], start: int, end: int, keep_reused: bool = False
) -> tuple[int, int, list[Allocation]]:
    """Replay all events up to ``end`` (so frees of earlier allocations count): (the peak above
    the level at ``start``, the level at ``end`` above it, the window's allocations live at the
    peak). ``keep_reused``: an allocation whose address is taken again without a recorded free
    stays live (what an accounting that misses some frees sees) instead of being replaced."""
    level = baseline = peak = 0
    live: dict[int, Allocation] = {}
    stuck: list[Allocation] = []
    live_at_peak: list[Allocation] = []
    for event in events:
        if event.time_ns > end:
            break
        level += event.nbytes
        if event.nbytes > 0:
            if keep_reused and event.ptr in live:
                stuck.append(live[event.ptr])
            live[event.ptr] = event
        else:
            live.pop(event.ptr, None)
        if event.time_ns < start:
            baseline = level
        elif level - baseline > peak:
            peak = level - baseline
            live_at_peak = [a for a in (*stuck, *live.values()) if a.time_ns >= start]
    return peak, level - baseline, live_at_peak


def region_memory(events: list[Allocation], start: int, end: int) -> RegionMemory:
    """The window's peak and what holds it, by label (``replay``)."""
    peak, held, live_at_peak = replay(events, start, end)
    by_label: dict[str, int] = defaultdict(int)
    for allocation in live_at_peak:
        by_label[allocation.label] += allocation.nbytes
    ordered = dict(sorted(by_label.items(), key=lambda item: -item[1]))
    return RegionMemory(peak, held, ordered)


def profiler() -> profile:
    """A CPU profiler recording allocations, with the Python stacks that label them."""
    return profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    )


def _freed_by_another_thread(nbytes: int) -> threading.Thread:
    """Allocate ``nbytes`` and hand the only reference to a thread that drops it after this frame
    returns, as gloo's worker thread does with all-to-all buffers. Join the returned thread."""
    box = [torch.empty(nbytes, dtype=torch.uint8)]
    thread = threading.Thread(target=lambda: (time.sleep(0.01), box.clear()))
    thread.start()
    return thread


def check_tracker() -> None:
    """Known peaks must come out exactly: 1 + 3 MiB live, then 3 + 2 MiB after a free, then a
    4 MiB buffer whose free happens on another thread must not count as live at the end."""
    with profiler() as prof:
        with record_function(_CHECK):
            a = torch.empty(MiB, dtype=torch.uint8)
            b = torch.empty(3 * MiB, dtype=torch.uint8)
            del a
            c = torch.empty(2 * MiB, dtype=torch.uint8)
            del b, c
            _freed_by_another_thread(4 * MiB).join()
    events, put_back = allocations(prof, alive=set())
    result = region_memory(events, *region(prof, _CHECK))
    if (result.peak_bytes, result.end_bytes, put_back) != (5 * MiB, 0, 1):
        raise RuntimeError(
            f"memory tracker is off: peak {result.peak_bytes}, end "
            f"{result.end_bytes}, frees put back {put_back}; expected "
            f"{5 * MiB}, 0, 1"
        )


def _gloo_rank(
    rank: int, world_size: int, store: str, result_path: str, measure_rank, args
) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        result = measure_rank(rank, *args)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    end_process(0)  # skips interpreter shutdown, where gloo threads can abort the process


def on_gloo_ranks(world_size: int, measure_rank, *args):
    """Run ``measure_rank(rank, *args)`` on ``world_size`` gloo processes (file:// rendezvous)
    and return rank 0's result, which must be JSON-serialisable."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.spawn(
            _gloo_rank,
            args=(world_size, os.path.join(tmp, "store"), result_path, measure_rank, args),
            nprocs=world_size,
            join=True,
        )
        with open(result_path) as f:
            return json.load(f)
