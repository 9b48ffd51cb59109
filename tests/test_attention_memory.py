"""What one attention layer holds, pinned per CP style, so that no change grows it silently
(issue 30: a float32 dx accumulator once added N x D x 2 bytes to UPipe's peak unnoticed; issue
40: a query-gradient buffer held beside dx added N x D x 4 to UPipe's backward without
checkpointing, +14%, which the derived pins below did not see: they run the checkpointed path).

Every test runs on one process over PyTorch's fake process group (rank 0 of C = 2: the exchanges
are posted as on a real group; no data moves).

The op's backward under activation checkpointing, against its derivation, counted by the
project's live-tensor tracker above the level at the backward's start:

- ``test_planned_backward_memory``: on fake tensors with the CUDA kernels traced (``fa3``) and
  FlashAttention-3's backward workspace allocated, exactly as the memory planner counts it;
- ``test_real_backward_memory_on_cpu``: on real CPU tensors with the CPU attention kernel, the op
  run through the same Python bodies (``transparent_ops``) so the tracker sees the buffers inside
  it (and the loops run in full: on fake tensors ``kernels.tiling`` runs a few identical ones).
  The CPU kernel's own scratch is torch's and not counted.

The backward receives its saved output as scratch, as under activation checkpointing (every
long-context recipe): the query gradients wait in it. Geometry: H = 8 query heads, H_kv = 2 KV
heads, head_dim d = 64, D = H*d = 512, N = 512 tokens per rank (S = 1024), bf16; RoPE tiles of 64
tokens, so that their float32 temporaries stay small next to the activations, as at long context.
Every expected value is a sum of named tensors (the ``_Sizes`` fields): what must be live at the
backward's peak, in the comment beside it.

The whole layer as the model calls it (RoPE, the op, ``wo``, every gradient), forward and
backward, without checkpointing, in every style (UPipe at U = C and 2C, Ulysses, ring, FPDT,
UPipe x FPDT), against measured numbers within 3%:

- ``test_real_layer_memory_on_cpu``: real CPU tensors, every allocation from the profiler's
  memory events (``benchmarks/live_memory.py``, the attention-memory benchmark's measure), the
  CPU kernel's scratch included;
- ``test_planned_layer_memory``: the planner's count, the attention category of the tracker on
  fake tensors with the CUDA kernels traced.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import llama3_attention
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.profiler import ProfilerActivity, profile, record_function
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from upipe_dtensor.kernels import rope
from upipe_dtensor.modes import loops
from upipe_dtensor.modes.ops import transparent_ops
from upipe_dtensor.modes.traces import forget_per_trace_caches
from upipe_dtensor.parallel.attention_op import ALL_GRADIENTS, AttentionParams, AttentionWeights
from upipe_dtensor.parallel.fpdt_attention import fpdt_backward, fpdt_forward
from upipe_dtensor.parallel.registry import make_style
from upipe_dtensor.parallel.staged_attention import staged_backward, staged_forward
from upipe_dtensor.planning.step_work import StepWorkCounter
from upipe_dtensor.planning.tracker import ATTENTION, LiveMemoryTracker
from upipe_dtensor.runtime.host_store import HostMemory

pytestmark = pytest.mark.unit

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

HEADS, KV_HEADS, HEAD_DIM, C, TOKENS = 8, 2, 64, 2, 512
DIM = HEADS * HEAD_DIM
BYTES = 2  # bf16
STYLES = ("upipe", "ulysses", "ring", "fpdt")
INDEX_SLACK = 1024
"""Bytes the pins allow above the sum: the int64 head indices of stages whose heads are not
contiguous (a few dozen bytes)."""


@dataclass(frozen=True)
class _Sizes:
    """Per-rank tensor sizes in bytes. A "head" is one head's (tokens, d) slice in bf16."""

    head: int = C * TOKENS * HEAD_DIM * BYTES
    """One head over the whole sequence (the head layout after the all-to-all)."""
    local_head: int = TOKENS * HEAD_DIM * BYTES
    """One head over this rank's tokens (the ring's layout, FPDT's chunk of two)."""
    output_weight_grad: int = DIM * DIM * BYTES
    """dwo: formed first with several stages, from grad_y and the saved output (which the waiting
    query gradients then overwrite); with one stage after its kernel, from its sequence layout
    exchanged back. dwk and dwv are created when their KV block closes, after the peaks below."""


def fa3_workspace(q_heads: int, kv_heads: int, q_tokens: int, k_tokens: int) -> int:
    """What FlashAttention-3's backward allocates besides its outputs (hopper/flash_api.cpp,
    ``mha_bwd``): a float32 dQ accumulator (h, round(Sq) x round_up_headdim(d)), float32 softmax_d
    and log2 LSE (h, round(Sq)) each, and with GQA float32 dK and dV accumulators per KV head.
    Sq and Sk are multiples of 128 here, so FA3's block rounding changes nothing; head_dim 64 is
    its own ``round_up_headdim``."""
    accumulators = 2 * kv_heads * k_tokens * HEAD_DIM * 4 if kv_heads != q_heads else 0
    return q_heads * q_tokens * HEAD_DIM * 4 + 2 * q_heads * q_tokens * 4 + accumulators


def _params(style: str, host: HostMemory, real: bool) -> AttentionParams:
    ring = style == "ring"
    group = dist.group.WORLD.group_name
    return AttentionParams(
        head_group="" if ring else group,
        head_degree=1 if ring else C,
        ring_group=group if ring else "",
        ring_degree=C if ring else 1,
        head_dim=HEAD_DIM,
        heads_per_stage=C if style == "upipe" else HEADS,
        chunks=2 if style == "fpdt" else 1,
        scale=HEAD_DIM**-0.5,
        backend="sdpa" if real else "fa3",
        kernel_device="cpu" if real else "cuda",
        store_name=host.name,
        output_is_scratch=True,
    )


def _backward_peak(style: str, real: bool) -> int:
    """Bytes the style's backward holds at its peak, above the level at its start."""
    host = HostMemory(torch.device("cpu" if real else "meta"))
    params = _params(style, host, real)
    forward, backward = (
        (fpdt_forward, fpdt_backward) if style == "fpdt" else (staged_forward, staged_backward)
    )
    tracker = LiveMemoryTracker()
    with FakeTensorMode() if not real else torch.no_grad(), transparent_ops(), tracker:
        torch.manual_seed(0)
        x = torch.randn(1, TOKENS, DIM, dtype=torch.bfloat16)
        rows = (HEADS, KV_HEADS, KV_HEADS)
        wq, wk, wv = (torch.randn(h * HEAD_DIM, DIM, dtype=torch.bfloat16) for h in rows)
        wo = torch.randn(DIM, DIM, dtype=torch.bfloat16)
        table = torch.randn(TOKENS, HEAD_DIM // 2, 2)
        weights = AttentionWeights(wq, wk, wv, wo)
        y, out, lse = forward(x, weights, table, None, params)
        grad_y = torch.randn_like(y)
        tracker.start_step()
        start = tracker.totals["cpu"]
        backward(grad_y, x, weights, table, None, out, lse, params)
        return tracker.peaks["cpu"].bytes - start


@pytest.fixture
def fake_process_group():
    """Rank 0 of C on the fake process group."""
    forget_per_trace_caches()  # cached on the tensors of another run (fake or real)
    dist.init_process_group("fake", rank=0, world_size=C, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_per_trace_caches()


@pytest.fixture
def one_thread():
    """Real CPU attention on one thread: the CPU kernel's backward keeps 1 MiB of scratch per
    thread, and with one head and two threads it runs about 50x slower than on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def fake_group(fake_process_group, monkeypatch: pytest.MonkeyPatch):
    """The op-level pins' group, with RoPE tiles of 64 tokens (the module docstring)."""
    monkeypatch.setattr(rope, "TILE_TOKENS", 64)


def _planned(style: str, size: _Sizes) -> int:
    """The backward's peak as planned (CUDA kernels traced), derived."""
    head, local = size.head, size.local_head
    if style == "upipe":
        # At the attention kernel of a stage after a KV block's first (U = C: one query head and
        # its KV head per rank, over the whole sequence): the stage's q, o, dO and the block's
        # k, v (5 heads); the block's dK, dV summed in float32 (4); the kernel's dq, dk, dv (3);
        # its workspace. No dx yet (it is created when the block closes) and no dQ buffer (the
        # saved output holds each stage's dQ).
        return 12 * head + fa3_workspace(1, 1, C * TOKENS, C * TOKENS) + size.output_weight_grad
    if style == "ulysses":
        # At its one attention kernel (4 query heads, 1 KV head per rank): q, dO (8 heads), k, v
        # (2); o is the saved output itself, kept in the head layout; the kernel's dq (4), dk, dv
        # (2), no accumulator for a block of one stage; its workspace with FA3's GQA dK/dV
        # accumulators. dwo is formed after the kernel, when its inputs are gone.
        return 16 * head + fa3_workspace(4, 1, C * TOKENS, C * TOKENS)
    if style == "ring":
        # At the first ring step's kernel, all 8 query and 2 KV heads of this rank's tokens:
        # q and k rotated (10 local heads), v (2), dO (8; o is the saved output itself), the
        # next block's k, v arriving (4), dQ summed over the steps in float32 (16), this block's
        # dK, dV in float32 (8), the kernel's dq, dk, dv (12), its workspace.
        return 60 * local + fa3_workspace(HEADS, KV_HEADS, TOKENS, TOKENS)  # dwo: after the ring
    if style == "fpdt":
        # At the first chunk pair's kernel (a global chunk of 512 tokens, 4 query heads and 1 KV
        # head per rank): that query chunk's q, o, dO and that K/V chunk's k, v fetched from the
        # host (14 local heads), the next query chunk's q, o, dO prefetched (12), dQ of the query
        # chunk and dK, dV of the K/V chunk in float32 (8 + 4), the kernel's dq, dk, dv (6), the
        # chunk's LSE rows made contiguous for the kernel; its workspace; dwk, dwv summed over
        # the chunks in float32.
        lse_rows = 4 * TOKENS * 4
        float32_kv_grads = 2 * KV_HEADS * HEAD_DIM * DIM * 4
        return (
            44 * local
            + lse_rows
            + fa3_workspace(4, 1, TOKENS, TOKENS)
            + DIM * DIM * BYTES
            + float32_kv_grads
        )
    raise AssertionError(style)


def _real(style: str, size: _Sizes) -> int:
    """The backward's peak on real CPU tensors with the CPU kernel (no CUDA workspace), derived.
    The exchanges are waited for one at a time (stages in turn), each tensor let go once its send
    copy exists, so without the workspace the peak is still at the attention kernel."""
    head, local = size.head, size.local_head
    if style == "upipe":
        # As planned, without the workspace: a later stage's q, o, dO and the block's k, v (5
        # heads), the block's float32 dK, dV (4), the kernel's dq, dk, dv (3).
        return 12 * head + size.output_weight_grad
    if style == "ulysses":
        # Without the workspace the peak is after the kernel, as dQ comes back: dwo (formed
        # first after the kernel, 4 heads), the kernel's dk, dv (2) and dq (4, the send buffer
        # until the exchange is waited for), dQ's receive buffer and its sequence-layout copy
        # (8).
        return 14 * head + size.output_weight_grad
    if style == "ring":
        # Casting dQ back to bf16 after the last ring step: q, k rotated (10 local heads), v (2),
        # dO (8), the other rank's k, v (4), dQ in float32 (16) and in bf16 (8), this rank's dK,
        # dV back from the ring in float32 (8), and the float32 dK, dV of the block visited last,
        # still referenced after they were sent (8). dwo comes after the ring.
        return 64 * local
    raise AssertionError(style)


@pytest.mark.parametrize("style", STYLES)
def test_planned_backward_memory(fake_group, style: str) -> None:
    measured, expected = _backward_peak(style, real=False), _planned(style, _Sizes())
    assert 0 <= measured - expected <= INDEX_SLACK, (measured, expected)


def _backward_of_gradients(style: str, grads: int) -> tuple[int, int, float]:
    """(peak, bytes still allocated at the end, matmul FLOPs) of the style's backward asked for
    the gradients ``grads`` (``AttentionParams.grads``), planned as the planner counts it."""
    forget_per_trace_caches()  # cached on the other run's fake tensors
    host = HostMemory(torch.device("meta"))
    params = dataclasses.replace(_params(style, host, real=False), grads=grads)
    forward, backward = (
        (fpdt_forward, fpdt_backward) if style == "fpdt" else (staged_forward, staged_backward)
    )
    tracker = LiveMemoryTracker()
    counter = StepWorkCounter(torch.device("cpu"), torch.device("meta"), gpus_per_node=8)
    with FakeTensorMode(), transparent_ops(), tracker, counter:
        x = torch.empty(1, TOKENS, DIM, dtype=torch.bfloat16)
        rows = (HEADS, KV_HEADS, KV_HEADS)
        wq, wk, wv = (torch.empty(h * HEAD_DIM, DIM, dtype=torch.bfloat16) for h in rows)
        weights = AttentionWeights(wq, wk, wv, torch.empty(DIM, DIM, dtype=torch.bfloat16))
        table = torch.empty(TOKENS, HEAD_DIM // 2, 2)
        y, out, lse = forward(x, weights, table, None, params)
        tracker.start_step()
        start = tracker.totals["cpu"]
        counter.counting = True
        result = backward(torch.empty_like(y), x, weights, table, None, out, lse, params)
        counter.counting = False
        end = tracker.totals["cpu"] - start
        del result
        return tracker.peaks["cpu"].bytes - start, end, counter.work.matmul_flops


@pytest.mark.parametrize("style", STYLES)
def test_frozen_weights_cost_no_weight_gradient(fake_group, style: str) -> None:
    """Asked for dx alone (every weight frozen: ``ctx.needs_input_grad``), the backward ends
    holding exactly the weights' gradients fewer bytes and counts exactly their matmul FLOPs
    fewer (dwq, dwk, dwv, dwo: 2 N D per row of each), and peaks no higher."""
    peak, end, flops = _backward_of_gradients(style, ALL_GRADIENTS)
    frozen_peak, frozen_end, frozen_flops = _backward_of_gradients(style, 1)  # bit 0: x
    rows = 2 * HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM  # of wq, wo and wk, wv
    assert end - frozen_end == rows * DIM * BYTES
    assert flops - frozen_flops == 2 * TOKENS * DIM * rows
    assert frozen_peak <= peak


@pytest.mark.parametrize("style", ["upipe", "ulysses", "ring"])
def test_real_backward_memory_on_cpu(fake_group, one_thread, style: str) -> None:
    """FPDT is not run here: its parked chunks are CPU memory too, which the tracker cannot tell
    from the device's (the profiler-based benchmark separates them by the code that allocates
    them)."""
    measured, expected = _backward_peak(style, real=True), _real(style, _Sizes())
    assert 0 <= measured - expected <= INDEX_SLACK, (measured, expected)


# --- The whole layer as the model calls it, pinned to measured numbers (issue 40) ---------------

LAYER_HEADS, LAYER_HEAD_DIM, LAYER_SEQ = 8, 16, 8192
"""MHA (8 query and 8 KV heads), head_dim 16, D = 128, S = 8192 (N = 4096 tokens per rank of C =
2), float32: every stage closes a KV block at U = C, as in issue 40's geometry (32 heads, S = 32K,
4 ranks). One activation (N x D float32) is 2 MiB here, the weights 64 KiB each, and the CPU
attention kernel's own scratch 1 MiB per thread (run on one: the numbers must not depend on the
machine's cores)."""
LAYER_STYLES = {  # name -> the style's [parallelism] values
    "upipe, U = C": {"cp_style": "upipe", "heads_per_stage": C},
    "upipe, U = 2C": {"cp_style": "upipe", "heads_per_stage": 2 * C},
    "ulysses": {"cp_style": "ulysses"},
    "ring": {"cp_style": "ring"},
    "fpdt, 4 chunks": {"cp_style": "fpdt", "chunk_tokens": LAYER_SEQ // 4},
    "upipe x fpdt, U = C, 4 chunks": {
        "cp_style": "upipe",
        "heads_per_stage": C,
        "chunk_tokens": LAYER_SEQ // 4,
    },
}
TOLERANCE = 0.03
"""Relative: a change of a few percent fails (issue 40's growth was +14%); the measurements
themselves repeat to the byte (one thread, no allocator caching on CPU)."""

# (forward, backward) bytes above the level at the start of each, at its peak. Measured by the
# two tests below (a failure prints the measured pair), at the commit named beside each table;
# the numbers repeat to the byte, and are the same on both torchtitan generations (the layer is
# the same module on each: separate wq/wk/wv, RoPE from the float64 frequencies; measured on
# 0.2.2 and 0.3.0 at the port to this project's model, which left every number as it was with
# 0.2.2's own Attention and its RoPE table). A change that moves one legitimately updates it
# here in the same commit, saying why in its message.
REAL_LAYER_BYTES = {  # test_real_layer_memory_on_cpu, issue 50's op (see the comment below)
    "upipe, U = C": (5_636_096, 7_537_664),
    "upipe, U = 2C": (8_781_824, 11_731_968),
    "ulysses": (9_324_544, 15_729_664),
    "ring": (15_351_808, 26_215_424),
    "fpdt, 4 chunks": (6_856_704, 11_305_984),
    "upipe x fpdt, U = C, 4 chunks": (4_587_520, 5_374_976),
}
PLANNED_LAYER_BYTES = {  # test_planned_layer_memory, likewise
    "upipe, U = C": (5_832_704, 6_717_448),
    "upipe, U = 2C": (8_978_432, 10_944_520),
    "ulysses": (8_978_448, 15_007_752),
    "ring": (15_548_416, 25_493_512),
    "fpdt, 4 chunks": (7_053_312, 10_485_768),
    "upipe x fpdt, U = C, 4 chunks": (4_849_664, 4_530_184),
}
"""Issue 50 (against DeepSpeed's Ulysses) moved the staged op's rows: UPipe's stages in turn by
default, each exchange let go of its input before it posts, RoPE in place in eighths of the
shard, dwk/dwv made when their block closes, and one stage (Ulysses, ring) keeping its output in
the head layout backward reads it in. UPipe U = C: real forward 9,357,312 -> 5,636,096 bytes,
backward 12,846,080 -> 7,537,664; Ulysses 18,350,080 -> 9,324,544 and 25,362,432 -> 15,729,664.
FPDT's rows did not move."""


def _layer(name: str, **options) -> tuple[torch.nn.Module, tuple, dict]:
    """This project's Llama3 attention (MHA, ``harness.llama3_attention``: the same module on
    either torchtitan generation, separate wq/wk/wv, RoPE as float64 frequencies) in ``name``'s
    style (``options``: ``make_style``'s keywords), rank 0 of the fake process group, and the
    arguments its block passes it after ``x``."""
    layer, args, kwargs = llama3_attention(
        LAYER_HEADS, LAYER_HEADS, LAYER_SEQ, head_dim=LAYER_HEAD_DIM
    )
    mesh = init_device_mesh("cpu", (C,))
    return parallelize_module(layer, mesh, make_style(LAYER_STYLES[name], **options)), args, kwargs


def _live_memory():
    """benchmarks/live_memory.py: the profiler's allocation events replayed (the attention-memory
    benchmark's measure)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("live_memory")


def _real_layer_bytes(name: str) -> tuple[int, int]:
    """(forward, backward) peaks of the real CPU layer, rank 0 of C on the fake process group,
    from the profiler's allocation events: every CPU allocation, those inside the ops and the
    CPU kernel's own included. A full-size warm-up first: FPDT's host buffers are pooled, so the
    measured pass parks its chunks in the warm-up's and its host memory stays out of the count
    (the benchmark tells them apart by their stacks, which are slow to record)."""
    live = _live_memory()
    layer, args, kwargs = _layer(name)
    shape = (1, LAYER_SEQ // C, LAYER_HEADS * LAYER_HEAD_DIM)
    layer(torch.randn(shape), *args, **kwargs).sum().backward()  # the warm-up
    layer.zero_grad(set_to_none=True)
    x = torch.randn(shape, requires_grad=True)
    grad = torch.randn(shape)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("layer::forward"):
            y = layer(x, *args, **kwargs)
        with record_function("layer::backward"):
            y.backward(grad)
    survivors = [y, x.grad, *(p.grad for p in layer.parameters())]
    events, _ = live.allocations(prof, {t.untyped_storage().data_ptr() for t in survivors})
    return tuple(
        live.region_memory(events, *live.region(prof, f"layer::{phase}")).peak_bytes
        for phase in ("forward", "backward")
    )


def _planned_layer_bytes(name: str) -> tuple[int, int]:
    """(forward, backward) growth of the planner's attention category at each peak: the layer
    traced on fake tensors with the CUDA kernels (``kernel_device="cuda"``, the backend "auto"
    plans: aten's memory-efficient kernel in float32), FPDT's host buffers on ``meta``, counted
    by the live-tensor tracker, as ``planning.step`` plans a job."""
    layer, args, kwargs = _layer(name, kernel_device="cuda", host_device=torch.device("meta"))
    tracker = LiveMemoryTracker()

    def attention_from_here() -> Callable[[], int]:
        """From now on: how much the attention category grows by at the peak."""
        tracker.start_step()
        before = tracker.by_label["cpu"][ATTENTION]
        return lambda: tracker.peaks["cpu"].by_label.get(ATTENTION, 0) - before

    with FakeTensorMode(allow_non_fake_inputs=True), transparent_ops(), tracker:
        x = torch.empty(1, LAYER_SEQ // C, LAYER_HEADS * LAYER_HEAD_DIM, requires_grad=True)
        grad = torch.empty_like(x)
        grown = attention_from_here()
        y = layer(x, *args, **kwargs)
        forward = grown()
        grown = attention_from_here()
        y.backward(grad)
        return forward, grown()


def _check(measured: tuple[int, int], stored: tuple[int, int], what: str) -> None:
    for phase, got, pinned in zip(("forward", "backward"), measured, stored):
        assert abs(got - pinned) <= TOLERANCE * pinned, (
            f"{what}: {phase} {got} bytes, pinned {pinned} (+-{TOLERANCE:.0%}); if the change "
            "is meant, update the pinned numbers in the same commit and say why"
        )


@pytest.mark.parametrize("name", LAYER_STYLES)
def test_real_layer_memory_on_cpu(fake_process_group, one_thread, name: str) -> None:
    measured = _real_layer_bytes(name)
    _check(measured, REAL_LAYER_BYTES[name], f"{name}, measured {measured}")


@pytest.mark.parametrize("name", LAYER_STYLES)
def test_planned_layer_memory(fake_process_group, name: str) -> None:
    measured = _planned_layer_bytes(name)
    _check(measured, PLANNED_LAYER_BYTES[name], f"{name}, planned {measured}")


@pytest.mark.parametrize(
    "style,heads_per_stage,chunks,overlap",
    [
        ("fpdt", HEADS, 8, False),
        ("fpdt", C, 8, False),
        ("fpdt", HEADS, 4, False),
        ("upipe", C, 1, True),
        ("upipe", C, 1, False),
    ],
    ids=["fpdt", "upipe x fpdt", "fpdt, 4 chunks", "upipe", "upipe, stages in turn"],
)
def test_planned_loops_are_every_iteration(
    fake_process_group, monkeypatch, style: str, heads_per_stage: int, chunks: int, overlap: bool
) -> None:
    """On fake tensors FPDT's chunk loops run the first two chunks and the last, the second
    standing for the middle ones, and park stand-ins for what the others leave in host memory
    (``kernels.tiling.in_order``), and a stage loop whose stages repeat runs its first two
    stages and the last (``HeadStages.stage_order``): 8 chunks, one stage of all heads
    (FPDT) and four stages sharing a KV block (UPipe x FPDT: partial dK/dV parked between
    stages), 4 chunks (the middle query loop of three, whose diagonal pair counts once), and
    UPipe's four stages with the next stage's exchanges in flight and without. Forward and
    backward each hold the device and host memory of every iteration run, to the byte, at their
    peaks, what holds them and at the end, and count the same work."""
    forward, backward = (
        (fpdt_forward, fpdt_backward) if style == "fpdt" else (staged_forward, staged_backward)
    )

    def plan(every_chunk: bool) -> list:
        monkeypatch.setattr(loops, "_every_tile_when_planning", every_chunk)
        forget_per_trace_caches()  # cached on the other plan's fake tensors
        host = HostMemory(torch.device("meta"))
        params = dataclasses.replace(
            _params(style, host, real=False),
            heads_per_stage=heads_per_stage,
            chunks=chunks,
            overlap_stages=overlap,
        )
        tracker = LiveMemoryTracker()
        counter = StepWorkCounter(torch.device("cpu"), torch.device("meta"), gpus_per_node=8)
        counter.counting = True
        seen = []
        ops = _OpCount()
        with FakeTensorMode(), transparent_ops(), tracker, counter, ops:
            x = torch.empty(1, TOKENS, DIM, dtype=torch.bfloat16)
            rows = (HEADS, KV_HEADS, KV_HEADS)
            wq, wk, wv = (torch.empty(h * HEAD_DIM, DIM, dtype=torch.bfloat16) for h in rows)
            weights = AttentionWeights(wq, wk, wv, torch.empty(DIM, DIM, dtype=torch.bfloat16))
            table = torch.empty(TOKENS, HEAD_DIM // 2, 2)
            tracker.start_step()
            y, out, lse = forward(x, weights, table, None, params)
            seen.append({d: (p.bytes, p.by_label) for d, p in tracker.peaks.items()})
            tracker.start_step()
            grads = backward(torch.empty_like(y), x, weights, table, None, out, lse, params)
            seen.append({d: (p.bytes, p.by_label) for d, p in tracker.peaks.items()})
            del grads
            seen.append(dict(tracker.totals))
        seen.append(host.store(torch.device("cpu")).peak_host_bytes)
        return seen, counter.work, ops.calls

    (shortcut, work, ran), (every, every_work, every_ran) = plan(False), plan(True)
    assert ran < every_ran  # the shortcut skipped iterations
    assert shortcut == every
    counted, every_counted = _flat(dataclasses.asdict(work)), _flat(dataclasses.asdict(every_work))
    assert counted == pytest.approx(every_counted, rel=1e-9)
    assert every_counted["attention_flops", ("flash", "backward")] > 0


class _OpCount(TorchDispatchMode):
    """How many ops ran."""

    calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _flat(record: dict, prefix: tuple = ()) -> dict:
    """A nested record's numbers by their path of keys."""
    flat = {}
    for key, value in record.items():
        path = (*prefix, key)
        flat.update(_flat(value, path) if isinstance(value, dict) else {path: value})
    return flat
