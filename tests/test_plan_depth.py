"""A plan traced on a reduced-depth model (``planning/depth.py``, ``planning/timeline.py``) is the
full trace's, to the byte: peak device and host bytes, what holds the peak and when, the counted
work, the rehearsal's syncs and collectives, the predicted times.

The reference is ``plan_job(..., full_trace=True)``, which traces every block. In every run: the
recipes' stacks on the debug model made deep enough that runs of alike blocks are shortened
(several inserted copies each), one job per style family (UPipe alone, with FPDT's chunks, 2D
with a ring, ring and FPDT baselines), with kept attention on host and device, checkpoint pairs,
FSDP CPU offload, block-input prefetch on and off, both model families, a CPU plan, and two
micro-batches. With ``--slow``: every shipped recipe at its own depth (minutes each).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch.distributed as dist

from upipe_dtensor.config import parse_args
from upipe_dtensor.models import llama3, qwen3
from upipe_dtensor.planning.depth import reduce_depth
from upipe_dtensor.planning.step import Budget, GiB, Plan, plan_job

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "train_configs/debug_model.toml")
RECIPES = sorted(str(p.relative_to(REPO)) for p in (REPO / "recipes").rglob("*.toml"))


@pytest.fixture(autouse=True)
def _no_leftover_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def assert_same_plan(fast: Plan, full: Plan) -> None:
    """Bytes identical, counts and times within 1e-9 (float sums in another order)."""
    assert fast.traced_layers < full.traced_layers == full.n_layers == fast.n_layers
    for name in (
        "device_peak_bytes",
        "device_peak_when",
        "device_breakdown",
        "host_peak_bytes",
        "host_per_node_bytes",
        "host_syncs_per_step",
        "host_syncs",
        "collectives",
    ):
        assert getattr(fast, name) == getattr(full, name), name
    if full.speed is None:
        assert fast.speed is None
        return
    assert fast.speed.work.keys() == full.speed.work.keys()
    for key, value in full.speed.work.items():
        assert fast.speed.work[key] == pytest.approx(value, rel=1e-9), key
    for name in ("step_time_s", "tokens_per_s_per_gpu", "mfu"):
        assert getattr(fast.speed, name) == pytest.approx(getattr(full.speed, name), rel=1e-9)
    assert fast.speed.step_time_range_s == pytest.approx(full.speed.step_time_range_s, rel=1e-9)


STACK = [
    "--activation_checkpoint.mode",
    "full",
    "--activation_checkpoint.cpu_offload",
    "true",
    "--memory.tiled_mlp",
    "true",
    "--memory.mlp_tile_tokens",
    "96",
    "--memory.tiled_rms_norm",
    "true",
    "--memory.chunked_loss",
    "true",
    "--memory.loss_chunk_tokens",
    "128",
    "--compile.enable",
    "true",
    "--parallelism.heads_per_stage",
    "4",
]
JOBS = {  # name: (model family, blocks, planner target, overrides)
    # 8B 2M-5M: kept on the host from block 5 of 11, FSDP CPU offload, no prefetch
    "upipe, host-kept last blocks, FSDP offload": (
        "llama3",
        11,
        "cuda",
        [
            *STACK[:-2],
            "--parallelism.heads_per_stage",
            "8",
            "--activation_checkpoint.keep_attention",
            "host",
            "--activation_checkpoint.keep_attention_skip_first",
            "5",
            "--activation_checkpoint.cpu_offload_prefetch",
            "false",
            "--training.enable_cpu_offload",
            "true",
        ],
    ),
    # 8B 8M, H200 13M, 32B 6M: UPipe x FPDT, checkpoint pairs (every pair alike: the last
    # block's input offloaded too, no block's parameters resharded); eager
    "upipe x fpdt, pairs, eager": (
        "llama3",
        10,
        "cuda",
        [
            *STACK[:-6],
            "--parallelism.heads_per_stage",
            "8",
            "--parallelism.fpdt_chunk_tokens",
            "256",
            "--activation_checkpoint.blocks_per_checkpoint",
            "2",
            "--activation_checkpoint.cpu_offload_skip_last",
            "0",
            "--parallelism.fsdp_reshard_after_forward",
            "false",
        ],
    ),
    # 8B 128K-1M and the 2D recipes: kept on the device, prefetch, overlapped stages, ring of 2
    "2d, device-kept, overlapped stages": (
        "llama3",
        9,
        "cuda",
        [
            *STACK,
            "--parallelism.context_parallel_degree",
            "4",
            "--parallelism.ring_degree",
            "2",
            "--activation_checkpoint.keep_attention",
            "device",
            "--parallelism.overlap_stages",
            "true",
        ],
    ),
    # the ring baselines, Qwen3, a CPU plan, two micro-batches
    "ring, qwen3, cpu, micro-batches": (
        "qwen3",
        8,
        "cpu",
        [
            *STACK[:4],
            "--parallelism.cp_style",
            "ring",
            "--training.gradient_accumulation_steps",
            "2",
        ],
    ),
    # the FPDT baselines; eager
    "fpdt, eager": (
        "llama3",
        6,
        "cuda",
        [*STACK[:-6], "--parallelism.cp_style", "fpdt", "--parallelism.fpdt_chunk_tokens", "256"],
    ),
}


@pytest.mark.parametrize("job", list(JOBS))
def test_reduced_depth_plan_is_the_full_trace(monkeypatch, job: str) -> None:
    family, layers, target, extra = JOBS[job]
    flavors = {"llama3": llama3.FLAVORS, "qwen3": qwen3.FLAVORS}[family]
    monkeypatch.setitem(
        flavors, "debugmodel", dataclasses.replace(flavors["debugmodel"], n_layers=layers)
    )
    config = parse_args(
        [
            "--config",
            DEBUG,
            "--model.name",
            family,
            "--training.seq_len",
            "512",
            "--training.local_batch_size",
            "1",
            *extra,
        ]
    )
    reduction = reduce_depth(config)
    assert reduction is not None and reduction.traced_layers < layers, job
    assert_same_plan(
        plan_job(config, target=target), plan_job(config, target=target, full_trace=True)
    )


def test_traced_and_inserted_blocks_are_every_block_once() -> None:
    """The 8B 5M recipe's reduced model (7 of 32 blocks) with the periods it inserts and the
    stand-ins it holds covers each of the 32 blocks once, forward and backward."""
    reduction = reduce_depth(parse_args(["--config", str(REPO / "recipes/llama3_8b_5M.toml")]))
    assert (reduction.n_layers, reduction.traced_layers) == (32, 7)
    for phase in ("forward", "backward"):
        blocks = [reduction.full_block(b) for b in range(reduction.traced_layers)]
        for (copied, unit), copies in reduction.copies.items():
            if copied == phase:
                first = unit * reduction.unit_blocks
                blocks += [reduction.copy_block(phase, first, c) for c in range(copies)]
        assert sorted(blocks) == list(range(32)), phase
    stand_ins = sorted(block for block, _ in reduction.stand_ins)
    copied = sorted(
        reduction.copy_block("forward", unit * reduction.unit_blocks, c)
        for (phase, unit), n in reduction.copies.items()
        if phase == "forward"
        for c in range(n)
    )
    assert stand_ins == copied
    no_checkpoints = parse_args(
        [
            "--config",
            str(REPO / "recipes/llama3_8b_5M.toml"),
            "--activation_checkpoint.mode",
            "none",
        ]
    )
    assert reduce_depth(no_checkpoints) is None  # backward has no per-block phases: full trace


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_plans_as_its_full_trace(recipe: str) -> None:
    config = parse_args(["--config", str(REPO / recipe)])
    budget = Budget(device_bytes=140 * GiB, gpu="h200") if "h200" in recipe else None
    assert_same_plan(plan_job(config, budget), plan_job(config, budget, full_trace=True))
