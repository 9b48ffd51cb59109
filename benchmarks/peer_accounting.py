"""Three accountings of one attention layer's peak, side by side, in the same window of the same
run (issue 57): why an independent harness measured other ratios to DeepSpeed's Ulysses than
``peer_attention.py`` did, and which accounting stands.

* **calling thread**: torch.profiler's allocator events as recorded (the independent harness's
  measure). The profiler records on the thread that runs the layer; a buffer whose last
  reference gloo's worker thread drops (an all-to-all's input or output, which its work object
  holds) is never seen free and counts as live to the end.
* **old**: the same events with those frees put back by a rule (``live_memory.allocations``:
  at the return of the Python frame that allocated it, or when its address is reused): what
  ``peer_attention.py`` measured before the trace.
* **trace**: every thread's allocations and frees (``alloc_trace``), what ``peer_attention.py``
  measures now: no rule, every byte the layer holds counted until whichever thread frees it.
  In the profiled window only torch's allocator's blocks are counted (the profiler's own
  buffers are malloc'd); **trace, unprofiled** is ``peer_attention.py``'s own figure, from the
  same call without the profiler.

For DeepSpeed's Ulysses and UPipe (U = C), plain and checkpointed, trainable weights: the peaks
(max over ranks) and, on the rank where they differ most, every allocation of the window
live at one measure's peak but not at all three (size, who allocated it, the threads that
freed it).

Run: ``python benchmarks/peer_accounting.py [--geometry 32/8/16/16K] [--cp 4]`` (about 5
minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import threading
from collections import Counter, defaultdict
from dataclasses import asdict

import torch.distributed as dist
from alloc_trace import Record, live_at_peak, peak, preloaded, traced
from live_memory import Allocation, MiB, allocations, on_gloo_ranks, profiler, region, replay
from peer_attention import (
    DTYPES,
    PEER_ROWS,
    Geometry,
    Layer,
    Row,
    _peak,
    missing_peer,
    prepare,
    project_rows,
    settle,
)
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import record_function

WINDOW = "accounting::layer"
MEASURES = ("calling thread", "old", "trace")
COLUMNS = (*MEASURES, "trace, unprofiled")
MODES = {"plain": False, "ckpt": True}  # name -> checkpointed (trainable weights)


def _live_at_peak(events: list[Allocation], start: int, end: int) -> tuple[int, list[Allocation]]:
    """(peak bytes above the level at ``start``, the window's allocations live then), replaying
    every event: an allocation whose address is taken again without a recorded free stays live."""
    peak, _, at_peak = replay(events, start, end, keep_reused=True)
    return peak, at_peak


def _window(layer: Layer, x_shard: Tensor, grad: Tensor, checkpointed: bool) -> dict:
    """One forward and backward under the profiler and the trace: each measure's peak and the
    allocations live at some measure's peak but not at all (aggregated by size and origin)."""
    x = x_shard.clone().requires_grad_()
    settle()
    with profiler() as prof, record_function(WINDOW), traced() as trace:
        y = layer(x, checkpointed)
        y.backward(grad)
    grads = [p.grad for p in layer.module.parameters() if p.grad is not None]
    alive = {t.untyped_storage().data_ptr() for t in (y, x.grad, *grads)}
    start, end = region(prof, WINDOW)
    raw, _ = allocations(prof, alive, put_back=False)
    old, _ = allocations(prof, alive)
    calling_peak, calling_live = _live_at_peak(raw, start, end)
    old_peak, old_live = _live_at_peak(old, start, end)
    # torch's allocator's blocks only: the profiler's own buffers are malloc'd (the benchmark's
    # figure, ``peer_attention._peak``, comes from a window without the profiler)
    records = [r if r.aligned else Record(0, r.ptr, r.tid, False) for r in trace.records]
    trace_peak, trace_live = peak(records), [i for i, _ in live_at_peak(records)]

    # One identity per allocation: the profiler's event, matched to the trace's records of the
    # same address and size in order; the trace's other records are other threads' allocations.
    labels: dict[tuple, str] = {}
    queue: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    for a in raw:
        if a.nbytes > 0 and a.time_ns >= start:
            labels[(a.ptr, a.time_ns)] = a.label
            queue[(a.ptr, a.nbytes)].append((a.ptr, a.time_ns))
    me = threading.get_native_id()
    identity: dict[int, tuple] = {}
    freed_by: dict[tuple, str] = {}
    live_by_ptr: dict[int, tuple] = {}
    for index, record in enumerate(trace.records):
        if record.bytes > 0:
            pending = queue.get((record.ptr, record.bytes))
            key = pending.pop(0) if pending else ("trace", index)
            identity[index] = key
            live_by_ptr[record.ptr] = key
        elif record.ptr in live_by_ptr:
            thread = "the calling thread" if record.tid == me else "another thread"
            freed_by[live_by_ptr.pop(record.ptr)] = thread

    def describe(key: tuple, nbytes: int) -> tuple:
        if key in labels:
            label = labels[key]
        else:  # only the trace saw it
            record = trace.records[key[1]]
            thread = "the calling thread" if record.tid == me else "another thread"
            label = f"not in the profiler's events: allocated on {thread}"
        return (nbytes, label, freed_by.get(key, "not in the window"))

    live_sets = [
        {(a.ptr, a.time_ns): a.nbytes for a in calling_live},
        {(a.ptr, a.time_ns): a.nbytes for a in old_live},
        {identity[i]: trace.records[i].bytes for i in trace_live},
    ]
    differing: Counter = Counter()
    for key in set().union(*live_sets):
        where = tuple(key in s for s in live_sets)
        if not all(where):
            nbytes = next(s[key] for s in live_sets if key in s)
            differing[(*describe(key, nbytes), where)] += 1
    listing = [
        {"count": n, "bytes": b, "label": label, "freed on": freed, "live at peak of": where}
        for (b, label, freed, where), n in sorted(differing.items(), key=lambda i: -i[0][0] * i[1])
    ]
    peaks = dict(zip(MEASURES, (calling_peak, old_peak, trace_peak)))
    return {"peaks": peaks, "listing": listing}


def _rank(rank: int, geometry: Geometry, dtype_name: str, rows: list[dict]) -> list[dict]:
    dtype = DTYPES[dtype_name]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    reports = []
    for spec in rows:
        row = Row(spec["name"], spec["peer"], spec["style"], tuple(map(tuple, spec["options"])))
        layer, x_shard, grad = prepare(row, geometry, dtype, mesh)
        layer(x_shard.clone().requires_grad_(), False).backward(grad)  # as peer_attention's timing
        layer.module.zero_grad(set_to_none=True)
        mine = {}
        for mode, checkpointed in MODES.items():
            mine[mode] = _window(layer, x_shard, grad, checkpointed)
            layer.module.zero_grad(set_to_none=True)
            mine[mode]["peaks"]["trace, unprofiled"] = _peak(layer, x_shard, grad, checkpointed)[0]
            layer.module.zero_grad(set_to_none=True)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        reports.append({"row": spec["name"], "ranks": everyone})
    return reports


def report(reports: list[dict]) -> str:
    """Markdown: the peaks (MiB, max over ranks, ratio to the first row's), then per row and
    mode the differing allocations of the rank where the measures differ most."""

    def spread(window: dict) -> tuple[int, int]:
        peaks = [window["peaks"][m] for m in MEASURES]
        return max(peaks) - min(peaks), window["peaks"]["trace"]

    def top(ranks: list[dict], mode: str, measure: str) -> int:
        return max(r[mode]["peaks"][measure] for r in ranks)

    first = reports[0]["ranks"]
    lines = ["| row | mode | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---:|" * len(COLUMNS)]
    for entry in reports:
        for mode in MODES:
            cells = []
            for measure in COLUMNS:
                mib, ratio = top(entry["ranks"], mode, measure), top(first, mode, measure)
                cells.append(f"{mib / MiB:.1f} ({mib / ratio:.2f}x)")
            lines.append(f"| {entry['row']} | {mode} | " + " | ".join(cells) + " |")
    for entry in reports:
        for mode in MODES:
            rank = max(range(len(entry["ranks"])), key=lambda r: spread(entry["ranks"][r][mode]))
            window = entry["ranks"][rank][mode]
            peaks = ", ".join(f"{m} {window['peaks'][m] / MiB:.1f} MiB" for m in MEASURES)
            heading = f"{entry['row']}, {mode}, rank {rank} ({peaks}): allocations live at the "
            if not window["listing"]:
                lines += ["", heading + "peak of each measure: the same"]
                continue
            lines += [
                "",
                heading + "peak of some measures but not all",
                "",
                "| n x MiB | allocated by | freed on | " + " | ".join(MEASURES) + " |",
                "|---:|---|---|:-:|:-:|:-:|",
            ]
            for item in window["listing"]:
                marks = " | ".join("live" if w else "" for w in item["live at peak of"])
                lines.append(
                    f"| {item['count']} x {item['bytes'] / MiB:.2f} | {item['label']} | "
                    f"{item['freed on']} | {marks} |"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", type=Geometry.parse, default=Geometry(32, 8, 16, 16384))
    parser.add_argument("--cp", type=int, default=4)
    args = parser.parse_args()
    if missing_peer("deepspeed"):
        raise SystemExit("DeepSpeed is not installed: pip install -e '.[peers]'")
    upipe = next(r for r in project_rows(args.cp, args.geometry.seq_len) if r.style == "upipe")
    rows = [asdict(PEER_ROWS[0]), asdict(upipe)]
    with preloaded():
        reports = on_gloo_ranks(args.cp, _rank, args.geometry, "float32", rows)
    print(
        f"{args.geometry}, C = {args.cp} gloo ranks, float32, trainable weights: the layer's "
        "peak in MiB above the level before its forward, forward and backward in one window\n"
    )
    print(report(reports))


if __name__ == "__main__":
    main()
