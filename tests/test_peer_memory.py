"""One Llama3 attention layer's peak beside DeepSpeed's Ulysses, pinned (``benchmarks/
peer_attention.py``, whose measure this is: the layer's forward and backward in one window, from
before the forward, every thread's allocations and frees from its allocation trace; plain and
checkpointed, trainable and frozen weights): this project's Ulysses at most DeepSpeed's in every
mode, and UPipe (U = C, the style's defaults) at most the ratios it reached when they were
stored, a few hundredths above them (``LIMITS``), so that a change that grows it fails. Issue 50
asks for 0.70x plain and 0.50x checkpointed: plain holds here, with trainable and frozen
weights; checkpointed is 0.52x trainable (the window ends holding y, dx and the weights'
gradients, 0.39x DeepSpeed's peak, whatever the style) and 0.44x frozen (docs/memory-stack.md
says where the bytes go).

On 4 gloo ranks, float32, Llama3-8B's head layout (32 query heads, 8 KV heads) with heads of 32
(D = 1024) at S = 8192, 2,048 tokens per rank. DeepSpeed comes with the ``peers`` extra, which CI
installs, and its outputs and gradients are compared too; without it the ratios are taken to the
DeepSpeed peaks stored below (measured beside it when they were stored). About 70 s on 2 cores.
The trace's own test makes a buffer that another thread frees, as gloo's worker threads free
all-to-all buffers (a few seconds: one Python process that imports torch).
"""

from __future__ import annotations

import importlib
import json
import sys

import pytest
from harness import REPO, run_command

pytestmark = pytest.mark.distributed

sys.path.insert(0, str(REPO / "benchmarks"))
peer_attention = importlib.import_module("peer_attention")
alloc_trace = importlib.import_module("alloc_trace")

MiB = 2**20
_FREED_ON_ANOTHER_THREAD = """
import json, sys, threading, torch
sys.path.insert(0, "benchmarks")
import alloc_trace
box = []
with alloc_trace.traced() as trace:
    box.append(torch.empty(4 * 2**20, dtype=torch.uint8))
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join()
me = threading.get_native_id()
print(json.dumps([(r.bytes, r.tid == me) for r in trace.records if r.aligned]))
"""


def test_the_trace_sees_a_free_on_another_thread() -> None:
    """The peak's measure counts a buffer until whichever thread frees it: a 4 MiB tensor made
    on the calling thread and freed on another (as gloo's worker threads free all-to-all
    buffers, which the profiler never sees free) is logged both times, with its size."""
    with alloc_trace.preloaded():
        code, out, err = run_command("-c", _FREED_ON_ANOTHER_THREAD, timeout=60)
    assert code == 0, err
    assert json.loads(out) == [[4 * MiB, True], [-4 * MiB, False]]


CP = 4
GEOMETRY = peer_attention.Geometry(n_heads=32, n_kv_heads=8, head_dim=32, seq_len=8192)
DEEPSPEED_PEAKS = {  # bytes: peer_attention.py beside DeepSpeed 0.19.8, at the commit of this line
    "plain": 61_341_696,
    "ckpt": 69_740_416,
    "plain frozen": 61_341_696,
    "ckpt frozen": 69_740_416,
}
LIMITS = {  # the highest ratio to DeepSpeed's peak, per mode
    "ours: Ulysses": {"plain": 1.0, "ckpt": 1.0, "plain frozen": 1.0, "ckpt frozen": 1.0},
    "ours: UPipe, U = C": {"plain": 0.68, "ckpt": 0.54, "plain frozen": 0.63, "ckpt frozen": 0.47},
}


def test_ulysses_and_upipe_against_deepspeeds_ulysses() -> None:
    installed = not peer_attention.missing_peer("deepspeed")
    rows = [r for r in peer_attention.project_rows(CP, GEOMETRY.seq_len) if r.name in LIMITS]
    if installed:
        rows = [peer_attention.PEER_ROWS[0], *rows]
    reports = {r["row"]["name"]: r for r in peer_attention.run(GEOMETRY, rows, CP, "float32")}
    peaks = reports.pop("DeepSpeed Ulysses")["peaks"] if installed else DEEPSPEED_PEAKS
    for name, report in reports.items():
        if installed:  # the same outputs and gradients as DeepSpeed's
            assert report["max_difference"]["trainable"] < 1e-4, (name, report)
            assert report["max_difference"]["frozen"] < 1e-5, (name, report)
        for mode, limit in LIMITS[name].items():
            ratio = report["peaks"][mode] / peaks[mode]
            assert ratio <= limit, (name, mode, f"{ratio:.3f}x DeepSpeed's, at most {limit}")
