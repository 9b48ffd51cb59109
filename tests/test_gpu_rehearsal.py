"""The first GPU run, rehearsed on CPU: the whole traced step, not only its attention.

The planner's GPU plans record what only a CUDA job would show (``planning.rehearsal``): the
process-group backend the job initialises and every collective's device type (a host collective
without a CPU backend is refused), and the host syncs of one step, which must not grow with
layers, head stages, sequence chunks or ring steps, for every style (with and without documents,
2D, kept attention, FSDP CPU offload). Also the other GPU-only defects of the desk audit
(research/reviews/gpu-path-audit.md) that a CPU test can show: document boundaries built per
block, RoPE frequencies rounded by FSDP2's mixed precision, kernel backends accepted because they
import, gpu_check ending at its first failure, and kept attention lost inside checkpoint groups.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import sys
import types
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from upipe_dtensor.config import ConfigError, parse_args
from upipe_dtensor.kernels import attention, backends, probe
from upipe_dtensor.kernels.attention import attention_backward, attention_forward
from upipe_dtensor.kernels.document_blocks import varlen_seqlens
from upipe_dtensor.models import FLAVORS
from upipe_dtensor.parallel import style as style_module
from upipe_dtensor.planning import step as planning_step
from upipe_dtensor.planning.rehearsal import GpuRehearsal
from upipe_dtensor.planning.step import plan_job
from upipe_dtensor.runtime.group_backends import backend_device_types
from upipe_dtensor.runtime.process_group import process_group_backend
from upipe_dtensor.train import build
from upipe_dtensor.verify import gpu_check

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "train_configs/debug_model.toml")
DOCUMENTS = ["--training.attention_mask", "document", "--training.position_ids", "document"]
FULL = ["--activation_checkpoint.mode", "full"]


@pytest.fixture(autouse=True)
def _no_leftover_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _plan(monkeypatch, extra: list[str], layers: int = 2, full_trace: bool = False):
    """A GPU plan of the debug model (128 tokens, ``layers`` blocks) with ``extra`` overrides;
    ``full_trace``: every block traced and every attention computation run (none replayed)."""
    monkeypatch.setitem(
        FLAVORS, "debugmodel", dataclasses.replace(FLAVORS["debugmodel"], n_layers=layers)
    )
    config = parse_args(["--config", DEBUG, "--training.seq_len", "128", *extra])
    return plan_job(config, full_trace=full_trace)


def _cp(degree: int, ring: int = 1) -> list[str]:
    return [
        "--parallelism.context_parallel_degree",
        str(degree),
        "--parallelism.ring_degree",
        str(ring),
    ]


def _chunks(tokens: int) -> list[str]:
    return ["--parallelism.chunk_tokens", str(tokens)]


# style: (overrides, the smaller and the larger job: (overrides, layers), host syncs per step).
# The larger job has more layers and more of what the style repeats (stages, ring steps, chunks).
GROWTH = {
    "upipe with documents: layers, head stages": (
        DOCUMENTS,
        ((["--parallelism.heads_per_stage", "8"], 1), (["--parallelism.heads_per_stage", "2"], 2)),
        0,
    ),
    "ulysses with documents, attention kept on the device: layers": (
        [*DOCUMENTS, "--parallelism.cp_style", "ulysses", *FULL]
        + ["--activation_checkpoint.keep_attention", "device"],
        (([], 1), ([], 2)),
        0,
    ),
    "ring with documents: layers, ring steps": (
        [*DOCUMENTS, "--parallelism.cp_style", "ring"],
        ((_cp(2), 1), (_cp(4), 2)),
        0,
    ),
    "fpdt with documents: layers, chunks": (
        [*DOCUMENTS, "--parallelism.cp_style", "fpdt"],
        ((_chunks(64), 1), (_chunks(32), 2)),
        0,
    ),
    "2D upipe with documents: layers, ring steps": (
        DOCUMENTS,
        ((_cp(4, 2), 1), (_cp(4, 4), 2)),
        0,
    ),
    "upipe x fpdt without documents, kept on the host, both offloads: layers, chunks": (
        [*FULL, "--activation_checkpoint.cpu_offload", "true"]
        + ["--activation_checkpoint.keep_attention", "host"]
        + ["--training.enable_cpu_offload", "true"],
        ((_chunks(64), 1), (_chunks(32), 2)),
        1,  # FSDP2's wait for the offloaded gradients, once per backward
    ),
    "upipe compiled (blocks and tile kernels), both offloads: layers": (
        ["--compile.enable", "true", *FULL, "--activation_checkpoint.cpu_offload", "true"]
        + ["--training.enable_cpu_offload", "true"],
        (([], 1), ([], 2)),
        1,  # as above: a compiled block's own syncs are not seen (docs/gpu.md)
    ),
}


@pytest.mark.parametrize("name", GROWTH)
def test_host_syncs_per_step_do_not_grow(monkeypatch, name: str) -> None:
    common, sizes, expected = GROWTH[name]
    plans = [_plan(monkeypatch, [*common, *extra], layers) for extra, layers in sizes]
    counts = [plan.host_syncs_per_step for plan in plans]
    assert counts == [expected, expected], [plan.host_syncs for plan in plans]


def test_plan_reports_backend_collectives_and_syncs(monkeypatch) -> None:
    offloaded = _plan(monkeypatch, ["--training.enable_cpu_offload", "true"])
    assert offloaded.process_group_backend == "cuda:nccl,cpu:gloo"
    assert offloaded.collectives["all_reduce on cpu"] == 1  # clip_grad_norm_'s, on host grads
    assert offloaded.collectives["all_to_all on cuda"] > 0
    row = offloaded.as_dict()
    assert row["host_syncs_per_step"] == 1 and "finalize_backward" in row["host_syncs"][0]["site"]
    assert "process group        : cuda:nccl,cpu:gloo" in offloaded.render()
    plain = _plan(monkeypatch, [])
    assert plain.process_group_backend == "nccl"
    assert not any(key.endswith("on cpu") for key in plain.collectives)


def test_a_host_collective_without_a_cpu_backend_is_refused(monkeypatch) -> None:
    """NCCL alone (the backend every CUDA job had): FSDP CPU offload's gradient-norm all-reduce
    runs on host tensors, and the plan refuses the job."""
    monkeypatch.setattr(planning_step, "process_group_backend", lambda device, host: "nccl")
    with pytest.raises(ConfigError, match=r"all_reduce on cpu tensors .*'nccl'.* no cpu backend"):
        _plan(monkeypatch, ["--training.enable_cpu_offload", "true"])
    assert not dist.is_initialized()


def test_one_backend_function_names_the_cpu_backend_when_host_tensors_exist(monkeypatch) -> None:
    assert process_group_backend("cpu", False) == "gloo"
    assert process_group_backend("cuda", False) == "nccl"
    assert backend_device_types("cuda:nccl,cpu:gloo") == {"cuda": "nccl", "cpu": "gloo"}
    assert "cpu" not in backend_device_types("nccl")
    # What a CUDA job's set_up_job initialises: the same function's string.
    chosen = []
    monkeypatch.setattr(build, "pick_device", lambda config: torch.device("cuda", 0))
    monkeypatch.setattr(
        build, "resolve_attention", lambda *args, **kwargs: backends.Choice("sdpa", {})
    )

    def init(backend: str) -> None:
        chosen.append(backend)
        raise RuntimeError("stop before the meshes")

    monkeypatch.setattr(build, "_init_process_group", init)
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = parse_args(["--config", DEBUG, "--training.enable_cpu_offload", "true"])
    with pytest.raises(RuntimeError, match="stop before the meshes"):
        build.set_up_job(config)
    assert chosen == ["cuda:nccl,cpu:gloo"]


def test_document_boundaries_go_to_the_device_once_per_step_without_a_sync() -> None:
    """Real document ids, the CUDA branch on fake tensors: every diagonal block of a step (here
    the same one three times, forward and backward) reads one set of cu_seqlens, sent once,
    pinned and non_blocking; no block copies host data to the device."""
    docs = torch.tensor([[0] * 40 + [1] * 56, [0] * 10 + [1] * 30 + [2] * 56])
    with FakeTensorMode(allow_non_fake_inputs=True):
        rehearsal = GpuRehearsal(torch.device("cpu"), torch.device("meta"))
        rehearsal.counting = True
        with rehearsal.ops(), rehearsal.step():
            on_device = {"dtype": torch.bfloat16, "device": "cpu"}  # the GPU's stand-in
            q = torch.empty(2, 96, 4, 16, **on_device)
            k, v = torch.empty(2, 96, 2, 16, **on_device), torch.empty(2, 96, 2, 16, **on_device)
            for _ in range(3):
                out, lse = attention_forward(q, k, v, 0.25, "sdpa", q_docs=docs, k_docs=docs)
                attention_backward(out, q, k, v, out, lse, 0.25, "sdpa", q_docs=docs, k_docs=docs)
            cu, longest = varlen_seqlens(docs, q.device)
            assert varlen_seqlens(docs, q.device)[0] is cu and longest == 56
    assert rehearsal.report.host_syncs == {}


def test_rope_reaches_attention_in_float32_under_gpu_mixed_precision(monkeypatch) -> None:
    """FSDP2's mixed precision casts a unit's floating inputs to bf16 unless told not to: the
    float64 RoPE frequencies arrived rounded to bf16 (angles off by radians past a few hundred
    positions). The shard's table, computed once per forward in float64, arrives as it was."""
    seen = []
    forward = style_module.ContextParallelAttention._forward

    def spy(self, module, call):
        seen.append(None if call.rope_table is None else call.rope_table.dtype)
        return forward(self, module, call)

    monkeypatch.setattr(style_module.ContextParallelAttention, "_forward", spy)
    _plan(monkeypatch, [], layers=1)
    assert seen and set(seen) == {torch.float32}, seen


def _spy_kernel_calls(monkeypatch) -> Counter:
    calls: Counter = Counter()
    dispatch = FakeTensorMode.dispatch

    def spy(self, func, types, args=(), kwargs=None):
        calls[func.overloadpacket.__name__] += 1
        return dispatch(self, func, types, args, kwargs)

    monkeypatch.setattr(FakeTensorMode, "dispatch", spy)
    return calls


def test_kept_attention_serves_both_recomputes_of_a_checkpoint_group(monkeypatch) -> None:
    """Blocks checkpointed in pairs: the group's recompute and the inner block's own both reuse
    the kept attention, on the device or the host, so no attention forward runs twice (as
    without checkpointing). Counted on the full trace, where every computation runs its kernels
    (the default plan replays repeated ones: ``planning.replay``)."""
    calls = _spy_kernel_calls(monkeypatch)
    counts = []
    for where in ("none", "device", "host"):
        calls.clear()
        keep = ["--activation_checkpoint.keep_attention", where]
        pairs = ["--activation_checkpoint.blocks_per_checkpoint", "2"]
        _plan(monkeypatch, [*FULL, *keep, *pairs], full_trace=True)
        counts.append(calls["_flash_attention_forward"])
    recomputing, *kept = counts
    stages = 4  # U = C = 2 of 8 heads
    assert kept == [2 * stages] * 2 and recomputing == (2 + 2 + 1) * stages, counts


# --- kernel backends: accepted when they run, not when they import ---------------------------


@pytest.fixture
def hopper_with_every_kernel(monkeypatch):
    """A machine that looks like a Hopper GPU where every kernel is installed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(backends, "registry_impl_problem", lambda impl: None)
    monkeypatch.setattr(backends, "flash_attn_problem", lambda: None)


def test_a_backend_that_fails_its_probe_is_skipped_or_refused(
    hopper_with_every_kernel, monkeypatch
) -> None:
    probed = []

    def probe_problem(name, head_dim, dtype, documents):
        probed.append((name, head_dim, dtype, documents))
        return "fails a forward+backward probe (TypeError: fwd() takes 30 arguments)" * (
            name == "fa3"
        )

    monkeypatch.setattr(backends, "probe_problem", probe_problem)
    choice = backends.choose_backend("auto", "cuda", head_dim=64, dtype=torch.bfloat16)
    assert choice.backend == "cudnn" and "probe (TypeError" in choice.skipped["fa3"]
    assert probed == [("fa3", 64, torch.bfloat16, False), ("cudnn", 64, torch.bfloat16, False)]
    with pytest.raises(ValueError, match="'fa3': fails a forward\\+backward probe"):
        backends.choose_backend("fa3", "cuda", head_dim=64, dtype=torch.bfloat16)
    assert backends.choose_backend("fa4", "cuda", head_dim=64).backend == "fa4"


def test_fa4_must_be_the_flash_attn_4_package(monkeypatch) -> None:
    """flash-attn 2.8.3 installs an older flash_attn/cute/interface.py that imports just as
    well: without the flash-attn-4 distribution FA4 is not offered."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for name in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))

    def version(name: str) -> str:
        if name == "flash-attn-4":
            raise importlib.metadata.PackageNotFoundError(name)
        return "2.8.3"

    monkeypatch.setattr(backends.importlib.metadata, "version", version)
    backends.registry_impl_problem.cache_clear()
    try:
        problem = backends.registry_impl_problem("FA4")
    finally:
        backends.registry_impl_problem.cache_clear()
    assert "flash-attn-4 package is not installed" in problem and "[flash]" in problem


@pytest.mark.parametrize("documents", [False, True])
def test_the_probe_accepts_a_right_kernel_and_names_a_wrong_one(monkeypatch, documents) -> None:
    """The probe's own check, on the CPU kernel: right answers pass; an output off by 10% (a
    wrong layout or argument would be off by more) is named."""
    assert probe.run_probe("cpu", torch.device("cpu"), 64, torch.float32, documents) == ""
    forward = attention.attention_forward

    def wrong(*args, **kwargs):
        out, lse = forward(*args, **kwargs)
        return out * 1.1, lse

    monkeypatch.setattr(probe, "attention_forward", wrong)
    problem = probe.run_probe("cpu", torch.device("cpu"), 64, torch.float32, documents)
    assert problem.startswith("out is off by")


# --- gpu_check reports a failure and carries on ----------------------------------------------


def test_gpu_check_prints_its_whole_table_when_a_backend_fails(monkeypatch) -> None:
    """One backend whose attention raises: each of its styles is a failed row, the other
    backend's rows are measured, and the table prints."""
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "cp"))["cp"]
    make_styles = gpu_check._styles

    def styles(cp, seq_len, backend, device_type, two_d):
        made = make_styles(cp, seq_len, "sdpa", device_type, two_d)
        if backend == "failing":
            for style, _ in made.values():
                style._op = _raise_kernel_error
        return made

    monkeypatch.setattr(gpu_check, "_styles", styles)
    for name, value in (("HEADS", 4), ("HEAD_DIM", 16), ("TOKENS_PER_RANK", 64)):
        monkeypatch.setattr(gpu_check, name, value)  # a small model: this is about the rows
    rows = gpu_check.check_parity(mesh, torch.device("cpu"), ["sdpa", "failing"])
    failed = [row for row in rows if isinstance(row, gpu_check.FailedRow)]
    assert len(failed) == len(rows) // 2 == 5
    assert all(row.backend == "failing" and "injected kernel error" in row.error for row in failed)
    failure = "failed: RuntimeError: x"
    table = gpu_check.render(1, "cpu", rows, {"fa3": "no CUDA device"}, None, failure)
    assert table.count("| sdpa |") == 5 and table.count("| failing | failed: RuntimeError") == 5
    assert (
        "| (skipped) | fa3 | no CUDA device |" in table and "| failed: RuntimeError: x |" in table
    )


def _raise_kernel_error(*args, **kwargs):
    raise RuntimeError("injected kernel error (cudaErrorNoKernelImageForDevice)")
