"""The GPU step, traced on CPU: every style's bf16 training step through the CUDA kernels' branch.

aten's CUDA attention ops have meta kernels, so on fake CPU tensors the kernels a GPU job would
call run here, forward, backward and optimizer, under FSDP2 mixed precision (param bf16, reduce
float32). The planner's own step (``plan_job``, target "cuda") is what runs; a spy on the aten ops
proves which kernels were called, and that the CPU kernel was not. Document masks: the varlen
branch of aten's flash kernel is traced, with real document ids (UPipe) and in the planner, whose
fake document ids count as one document per row. Also: the backend choice, the
flash-attn import check with its fallback, and the per-backend head_dim and dtype checks.
"""

from __future__ import annotations

import sys
import types
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from upipe_dtensor.config import ConfigError, parse_args
from upipe_dtensor.kernels import backends
from upipe_dtensor.kernels.attention import attention_backward, attention_forward
from upipe_dtensor.planning.step import plan_job
from upipe_dtensor.runtime.peak_flops import peak_flops
from upipe_dtensor.train.build import set_up_job

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "train_configs/debug_model.toml")
KERNEL_OPS = {
    "flash": "_flash_attention_forward",
    "flash_bwd": "_flash_attention_backward",
    "cudnn": "_scaled_dot_product_cudnn_attention",
    "cudnn_bwd": "_scaled_dot_product_cudnn_attention_backward",
    "efficient": "_scaled_dot_product_efficient_attention",
    "efficient_bwd": "_scaled_dot_product_efficient_attention_backward",
    "cpu": "_scaled_dot_product_flash_attention_for_cpu",
}


@pytest.fixture
def kernel_calls(monkeypatch) -> Counter:
    """How often each attention kernel op ran on fake tensors (FakeTensorMode sees every op)."""
    names = {op_name: name for name, op_name in KERNEL_OPS.items()}
    calls: Counter = Counter()
    dispatch = FakeTensorMode.dispatch

    def spy(self, func, types, args=(), kwargs=None):
        name = names.get(func.overloadpacket.__name__)
        if name is not None:
            calls[name] += 1
        return dispatch(self, func, types, args, kwargs)

    monkeypatch.setattr(FakeTensorMode, "dispatch", spy)
    return calls


# Each style once with aten's flash kernel, each other backend once; cp 2 (2D: 2 x 2 on 4).
STEPS = {
    "upipe (auto plans fa3)": ([], "flash"),
    "ulysses": (["--parallelism.cp_style", "ulysses"], "flash"),
    "ring": (["--parallelism.cp_style", "ring"], "flash"),
    "fpdt": (
        ["--parallelism.cp_style", "fpdt", "--parallelism.chunk_tokens", "128"],
        "flash",
    ),
    "upipe-x-fpdt": (["--parallelism.chunk_tokens", "128"], "flash"),
    "upipe-2d": (
        ["--parallelism.context_parallel_degree", "4", "--parallelism.ring_degree", "2"],
        "flash",
    ),
    "cudnn": (["--parallelism.attention_backend", "cudnn"], "cudnn"),
    "fa4 (registry, aten's flash op)": (["--parallelism.attention_backend", "fa4"], "flash"),
    "flash-attn twin": (["--parallelism.attention_backend", "flash"], "flash"),
    "float32 -> efficient": (["--training.mixed_precision_param", "float32"], "efficient"),
    "documents (one varlen document per row)": (
        ["--training.attention_mask", "document", "--training.position_ids", "document"],
        "flash",
    ),
}


@pytest.mark.parametrize("name", STEPS)
def test_bf16_gpu_step_traces_the_cuda_kernels(name: str, kernel_calls: Counter) -> None:
    extra, kernel = STEPS[name]
    config = parse_args(["--config", DEBUG, "--training.seq_len", "512", *extra])
    plan = plan_job(config)
    assert plan.traced_on == "cuda"
    planned = {"auto": "sdpa" if kernel == "efficient" else "fa3"}
    backend = config.parallelism.attention_backend
    assert plan.attention_backend == planned.get(backend, backend)
    assert kernel_calls[kernel] > 0 and kernel_calls[f"{kernel}_bwd"] > 0, kernel_calls
    assert kernel_calls["cpu"] == 0, kernel_calls
    assert plan.device_peak_bytes > 0


def test_documents_trace_one_varlen_launch_per_block(kernel_calls: Counter) -> None:
    """Real document ids: every document of a diagonal block in one varlen call of aten's flash
    kernel (cum_seq given), forward and backward, with grouped K/V as they are."""
    batch, length, heads, kv_heads, head_dim = 2, 96, 4, 2, 16
    docs = torch.tensor([[0] * 40 + [1] * 56, [0] * 10 + [1] * 30 + [2] * 56])
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(batch, length, heads, head_dim, dtype=torch.bfloat16)
        k = torch.empty(batch, length, kv_heads, head_dim, dtype=torch.bfloat16)
        v = torch.empty_like(k)
        out, lse = attention_forward(q, k, v, 0.25, "sdpa", causal=True, q_docs=docs, k_docs=docs)
        grads = attention_backward(
            out, q, k, v, out, lse, 0.25, "sdpa", causal=True, q_docs=docs, k_docs=docs
        )
    assert (out.shape, lse.shape) == (q.shape, (batch, heads, length))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert kernel_calls["flash"] == 1 and kernel_calls["flash_bwd"] == 1


def test_cudnn_refuses_documents() -> None:
    with pytest.raises(ConfigError, match="'cudnn' cannot mask documents.*'flash' or 'sdpa'"):
        plan_job(
            parse_args(
                ["--config", DEBUG, "--parallelism.attention_backend", "cudnn"]
                + ["--training.attention_mask", "document"]
            )
        )


def test_float32_with_a_16_bit_kernel_is_refused_before_any_process_group() -> None:
    config = parse_args(
        ["--config", DEBUG, "--parallelism.attention_backend", "flash"]
        + ["--training.mixed_precision_param", "float32"]
    )
    with pytest.raises(ConfigError, match=r"'flash' runs head_dim .* in float32: use 'sdpa'"):
        plan_job(config)


def test_head_dim_is_checked_per_backend() -> None:
    backends.check_kernel_limits("sdpa", 128, torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"'cudnn' .* up to 128 .* head_dim 192.*'fa3' or 'flash' or 'sdpa'"
    ):
        backends.check_kernel_limits("cudnn", 192, torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim 20 in bfloat16: no CUDA kernel runs it"):
        backends.check_kernel_limits("flash", 20, torch.bfloat16)


def test_cuda_backends_need_cuda_and_auto_resolves_per_device() -> None:
    assert backends.resolve_backend("auto", "cpu") == "sdpa"
    assert backends.resolve_backend("auto", "cuda", traced=True) == "fa3"  # a Hopper plan
    float32 = backends.choose_backend("auto", "cuda", traced=True, dtype=torch.float32)
    assert float32.backend == "sdpa" and set(float32.skipped) == {"fa3", "cudnn", "fa4", "flash"}
    assert "no float32 kernel" in float32.skipped["fa3"]
    for name in ("cudnn", "fa3", "fa4", "flash"):
        with pytest.raises(ValueError, match=f"'{name}' needs a CUDA device; on cpu use 'sdpa'"):
            backends.resolve_backend(name, "cpu")


@pytest.fixture
def gpu_without_kernels(monkeypatch):
    """A machine that looks like it has a GPU of a chosen architecture where neither FA3 nor FA4
    imports and flash-attn is not installed: only what ships in torch (cuDNN, sdpa) runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    missing = {"FA3": "flash_attn_interface does not import", "FA4": "no flash_attn.cute"}
    monkeypatch.setattr(backends, "registry_impl_problem", missing.get)
    monkeypatch.setattr(backends, "flash_attn_problem", lambda: "flash-attn is not installed")
    monkeypatch.setattr(backends, "probe_problem", lambda *args: "")  # what is installed runs

    def on(major: int) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))

    return on


def test_auto_takes_the_fastest_kernel_that_runs_and_says_why(gpu_without_kernels) -> None:
    gpu_without_kernels(9)  # Hopper: fa3, cudnn, fa4, flash, sdpa
    hopper = backends.choose_backend("auto", "cuda", head_dim=128, dtype=torch.bfloat16)
    assert hopper.backend == "cudnn"
    assert hopper.describe() == "cudnn (auto; skipped fa3: flash_attn_interface does not import)"
    documents = backends.choose_backend("auto", "cuda", documents=True, dtype=torch.bfloat16)
    assert documents.backend == "sdpa"
    assert documents.skipped == {
        "fa3": "flash_attn_interface does not import",
        "cudnn": "no document masks",
        "fa4": "no flash_attn.cute",
        "flash": "flash-attn is not installed",
    }
    wide = backends.choose_backend("auto", "cuda", head_dim=192, dtype=torch.bfloat16)
    assert wide.backend == "sdpa" and "up to 128" in wide.skipped["cudnn"]
    gpu_without_kernels(8)  # Ampere: flash, sdpa (no cuDNN advantage published there)
    assert backends.choose_backend("auto", "cuda").skipped == {
        "flash": "flash-attn is not installed"
    }
    with pytest.raises(ValueError, match="'fa3': flash_attn_interface does not import"):
        backends.resolve_backend("fa3", "cuda")


def test_job_device_cuda_without_gpu_is_a_config_error() -> None:
    config = parse_args(
        ["--config", DEBUG, "--job.device", "cuda", "--parallelism.context_parallel_degree", "1"]
    )
    with pytest.raises(ConfigError, match=r"\[job\] device = 'cuda', but CUDA is not usable"):
        set_up_job(config)
    assert not dist.is_initialized()  # refused before any process group


@pytest.fixture
def broken_flash_attn(monkeypatch, tmp_path):
    """A flash-attn install whose compiled module does not load (built for another torch), on a
    machine that looks like it has CUDA."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "flash_attn_interface.py").write_text(
        "raise ImportError('undefined symbol: _ZN3c104cuda9SetDeviceEi')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends.importlib.metadata, "version", lambda name: "2.8.3")
    monkeypatch.setattr(backends, "probe_problem", lambda *args: "")  # what is installed runs
    backends.flash_attn_problem.cache_clear()
    yield
    sys.modules.pop("flash_attn", None)
    sys.modules.pop("flash_attn.flash_attn_interface", None)
    backends.flash_attn_problem.cache_clear()


def test_abi_mismatched_flash_attn_falls_back_under_auto(broken_flash_attn, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    choice = backends.choose_backend("auto", "cuda")
    assert choice.backend == "sdpa"
    assert "flash-attn 2.8.3 does not import" in choice.skipped["flash"]
    with pytest.raises(ValueError, match="'flash': flash-attn 2.8.3 does not import.*ImportError"):
        backends.resolve_backend("flash", "cuda")


def test_old_flash_attn_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setattr(backends.importlib.metadata, "version", lambda name: "2.6.3")
    backends.flash_attn_problem.cache_clear()
    try:
        with pytest.raises(ValueError, match="flash-attn 2.6.3 is older than 2.7.0"):
            backends.resolve_backend("flash", "cuda")
    finally:
        backends.flash_attn_problem.cache_clear()


@pytest.fixture(autouse=True)
def _no_leftover_group():
    yield
    if dist.is_initialized():  # a failed plan must not leave its fake group behind
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA GH200 480GB", None),
    ],
)
def test_mfu_peak_by_exact_device(monkeypatch, name: str, peak: float | None) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    found, why_not = peak_flops(torch.device("cuda", 0))
    assert found == peak
    assert why_not == ("" if peak else f"n/a (unknown GPU {name})")
