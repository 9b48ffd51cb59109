"""What the stand-in run (one device as rank 0 of a recipe, ``verify/stand_in.py``) relies on, in
one process: the fake group's exchanges hold finite local data only inside a stand-in run (a plan
never asks), FSDP2's reduce-scatter keeps this rank's own chunk, the ring stages CUDA tensors
through host memory exactly when the group's CUDA backend is gloo, and profiled kernels fall into
the step-time model's categories by their names, and the report a GPU run prints renders from a GPU
plan. The measured run itself, on CPU, is in ``tests/test_gpu_evidence.py``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from upipe_dtensor import gpu_check
from upipe_dtensor.config import ConfigError, parse_args
from upipe_dtensor.errors import JobError
from upipe_dtensor.models import FLAVORS
from upipe_dtensor.modes.fake_group import local_data_in_fake_collectives
from upipe_dtensor.parallel.all_to_all import start_sequence_to_heads
from upipe_dtensor.planning.step import Budget, plan_job
from upipe_dtensor.runtime.fake_process_group import LocalReduceScatter, fill_as_received
from upipe_dtensor.runtime.group_backends import stages_through_host
from upipe_dtensor.verify import stand_in
from upipe_dtensor.verify.stand_in import (
    CATEGORIES,
    Measured,
    classify,
    refuse_what_does_not_fit,
    report,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_group():
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_fake_exchanges_hold_local_data_only_in_a_stand_in_run(fake_group) -> None:
    x = torch.randn(1, 8, 4, 2)  # (B, S/C, heads, d) on 4 ranks
    with local_data_in_fake_collectives():
        heads = start_sequence_to_heads(x, fake_group, 4).result()  # (B, S, h/C, d)
    assert heads.shape == (1, 32, 1, 2)  # this rank's data where the peers' would be
    assert torch.equal(heads.flatten().sort().values, x.flatten().sort().values)
    received, sent = torch.zeros(3), torch.ones(3)
    fill_as_received([received], [sent], fake_group)  # a plan's exchanges: left alone
    assert torch.equal(received, torch.zeros(3))


def test_local_reduce_scatter_keeps_this_ranks_chunk(fake_group) -> None:
    unsharded = torch.arange(12.0)
    shard = LocalReduceScatter().allocate((3,), dtype=torch.float32, device=torch.device("cpu"))
    LocalReduceScatter()(shard, unsharded, fake_group, dist.ReduceOp.SUM)
    assert torch.equal(shard, torch.arange(3.0))  # rank 0's chunk


def test_ring_stages_cuda_tensors_through_host_only_on_gloo(tmp_path) -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for backend, store, staged in (
        ("fake", FakeStore(), False),
        ("gloo", dist.FileStore(str(tmp_path / "store"), 1), True),
    ):
        dist.init_process_group(backend, rank=0, world_size=1, store=store)
        try:
            group = dist.group.WORLD
            assert stages_through_host(group, cuda) == staged, backend
            assert not stages_through_host(group, cpu) and not stages_through_host(None, cuda)
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize(
    ("name", "category"),
    [
        (
            "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1",
            "matmul",
        ),
        ("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNN", "matmul"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention forward"),
        (
            "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<>",
            "attention backward",
        ),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention forward"),
        (
            "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_5",
            "attention backward",
        ),
        ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", "attention backward"),
        ("Memcpy HtoD (Pinned -> Device)", "host transfers"),
        ("Memcpy DtoD (Device -> Device)", "memory-bound ops"),
        ("triton_poi_fused__to_copy_add_mul_silu_0", "memory-bound ops"),
        ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ],
)
def test_kernels_fall_into_the_models_categories(name: str, category: str) -> None:
    assert classify(name, on_gpu=True) == category


def test_cpu_ops_fall_into_the_models_categories() -> None:
    assert classify("aten::addmm", on_gpu=False) == "matmul"
    assert (
        classify("aten::_scaled_dot_product_flash_attention_for_cpu_backward", on_gpu=False)
        == "attention backward"
    )
    assert classify("aten::copy_", on_gpu=False) == "memory-bound ops"


def test_a_gpu_plans_report_renders_every_row(monkeypatch) -> None:
    """The report a GPU stand-in prints, from a GPU plan (the debug job traced for CUDA, with
    activation offload) and measured numbers made up here: every memory row, the planned time of
    every category and the in-step rates against the H100 ranges (what only the lent GPU
    fills in for real)."""
    two_layers = dataclasses.replace(FLAVORS["debugmodel"], n_layers=2)
    monkeypatch.setitem(FLAVORS, "debugmodel", two_layers)
    config = parse_args([
        "--config", str(REPO / "train_configs/debug_model.toml"), "--training.seq_len", "256",
        "--activation_checkpoint.mode", "full", "--activation_checkpoint.cpu_offload", "true",
    ])  # fmt: skip
    plan = plan_job(config, Budget(gpu="h100-sxm"), target="cuda").as_dict()
    seconds = dict.fromkeys(CATEGORIES, 1e-3)
    measured = Measured(
        peak_allocated_bytes=plan["tracked_peak_bytes"],
        peak_reserved_bytes=plan["allocator_peak_bytes"],
        device_in_use_bytes=plan["device_peak_bytes"],
        host_offload_peak_bytes=plan["host_peak_bytes"],
        alloc_retries=0,
        step_seconds=[0.01, 0.01],
        losses=[8.0, 7.9],
        grad_norms=[1.0, float("nan")],
        by_category_s=seconds,
        top_kernels=[{"name": "nvjet_tst_x", "category": "matmul", "seconds": 1e-3}],
        profiled_step_s=0.012,
        build_and_first_step_s=30.0,
    )
    result, lines = report(config, 2, plan, measured, "NVIDIA H100 80GB HBM3")
    assert [row["what"] for row in result["memory"]] == [
        "peak allocated", "peak reserved", "device in use after the steps",
        "host (offloaded activations)",
    ]  # fmt: skip
    assert set(result["planned_by_category_s"]) == {*CATEGORIES, "step without collectives"}
    assert result["planned_by_category_s"]["host transfers"] > 0  # offloaded block inputs
    rates = {row["category"]: row for row in result["in_step_rates"]}
    assert {"matmul", "attention forward", "attention backward", "memory-bound ops"} <= set(rates)
    assert rates["matmul"]["low"] == 560e12 and rates["matmul"]["verdict"] in ("below", "inside")
    text = "\n".join(lines)
    assert "NOT FINITE" in text and "in-step rate, matmul" in text and "peak reserved" in text


def test_a_job_whose_host_share_does_not_fit_is_refused_before_anything_is_built() -> None:
    plan = {
        "host_peak_bytes": 10**15,
        "host_holds": "activation offload",
        "allocator_peak_bytes": 0,
    }
    with pytest.raises(ConfigError, match=r"holds 931322.6 GiB of host memory .* available"):
        refuse_what_does_not_fit(plan, torch.device("cpu"))
    refuse_what_does_not_fit(plan | {"host_peak_bytes": 2**20}, torch.device("cpu"))


def test_a_cpu_run_the_plan_says_takes_hours_is_refused_naming_the_form_that_runs(
    monkeypatch, capsys
) -> None:
    """The debug model at 256K tokens as rank 0 of 4 on CPU: its plan's FLOPs at this CPU's
    matmul rate take a day here (hours on any CPU), so the stand-in refuses in one line before
    building anything, naming the debug model's own form; that form passes the same judgement,
    and so does the long run given the time (--cpu-minutes), each going on to measure."""

    def measured(*args, **kwargs):
        raise JobError("measure() reached")

    monkeypatch.setattr(stand_in, "measure", measured)
    debug = [
        *(
            "--stand-in",
            "--device",
            "cpu",
            "--config",
            str(REPO / "train_configs/debug_model.toml"),
        ),
        *("--parallelism.context_parallel_degree", "4"),
    ]
    long = [*debug, "--training.seq_len", "262144"]
    assert gpu_check.main(long) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("config error:")]
    assert "debug_model.toml as rank 0 of 4 on CPU would take at least " in line
    assert "past --cpu-minutes 15. The form that runs on a CPU in minutes is the debug " in line
    assert line.endswith(f"{stand_in.CPU_FORM} (or raise --cpu-minutes to wait)")
    assert "measure() reached" not in err
    assert gpu_check.main(debug) == 1  # the debug form: judged short, measured
    assert "error: measure() reached" in capsys.readouterr().err
    assert gpu_check.main([*long, "--cpu-minutes", "1e9"]) == 1
    assert "error: measure() reached" in capsys.readouterr().err
    if not torch.cuda.is_available():  # README command 3 as typed on a CPU machine
        recipe = ["--stand-in", "--config", str(REPO / "recipes/llama3_8b_128K.toml")]
        assert gpu_check.main(recipe) == 2
        assert f"the CPU form is {stand_in.CPU_FORM}\n" in capsys.readouterr().err
