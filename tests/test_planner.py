"""The planner against reality on CPU, its CLI, and the promise that the 8B 5M recipe fits.

Reality: the same small jobs run for real on 2 and 4 gloo processes, with the same live-tensor
tracker on real tensors (custom ops transparent, so their inner buffers count) and the same step
procedure. The planner's fake run (fake process group, fake tensors, one process) must predict
each real rank's peak within 5%.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_on_ranks

from upipe_dtensor.config import parse_args
from upipe_dtensor.modes import loops as loop_modes
from upipe_dtensor.modes.ops import transparent_ops
from upipe_dtensor.planning import cli as plan_cli
from upipe_dtensor.planning.compiled import shared_compiles
from upipe_dtensor.planning.step import (
    CUDA_CONTEXT,
    NCCL_BUFFERS,
    Budget,
    CudaAllowances,
    plan_job,
    tracked_step,
)
from upipe_dtensor.planning.tracker import LiveMemoryTracker
from upipe_dtensor.train.trainer import Trainer

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
JOBS = {
    "upipe": [],
    "ulysses": ["--parallelism.cp_style", "ulysses"],
    "upipe+offload": [
        "--activation_checkpoint.mode",
        "full",
        "--activation_checkpoint.cpu_offload",
        "true",
    ],
    "upipe+tiling": [
        "--memory.tiled_mlp",
        "true",
        "--memory.mlp_tile_tokens",
        "64",
        "--memory.tiled_rms_norm",
        "true",
        "--memory.chunked_loss",
        "true",
        "--memory.loss_chunk_tokens",
        "128",
    ],
    "ulysses+all": [
        "--parallelism.cp_style",
        "ulysses",
        "--activation_checkpoint.mode",
        "full",
        "--activation_checkpoint.cpu_offload",
        "true",
        "--memory.tiled_mlp",
        "true",
        "--memory.tiled_rms_norm",
        "true",
        "--memory.chunked_loss",
        "true",
    ],
    "ring": ["--parallelism.cp_style", "ring"],
    # 4 chunks per rank at cp 2, 2 at cp 4: earlier K/V chunks in the host store
    "fpdt": ["--parallelism.cp_style", "fpdt", "--parallelism.chunk_tokens", "256"],
    "upipe-2d": ["--parallelism.ring_degree", "2"],  # 2 x 1 at cp 2, 2 x 2 at cp 4
    "qwen3-moe": ["--config", str(REPO / "train_configs/qwen3_moe_debug.toml")],
    "qwen3-moe+tiling": [
        "--config",
        str(REPO / "train_configs/qwen3_moe_debug.toml"),
        "--memory.tiled_mlp",
        "true",
        "--memory.mlp_tile_tokens",
        "128",
    ],
    "qwen3-moe, ep 2": [  # the planner's routing, round-robin, in the real run too
        "--config",
        str(REPO / "train_configs/qwen3_moe_debug.toml"),
        "--parallelism.expert_parallel_degree",
        "2",
        "--model.moe_force_load_balance",
        "true",
    ],
    "upipe+checkpoint_pairs": [
        "--activation_checkpoint.mode",
        "full",
        "--activation_checkpoint.cpu_offload",
        "true",
        "--activation_checkpoint.blocks_per_checkpoint",
        "2",
    ],
}


TP_JOBS = {  # 4 ranks as cp 2 x tp 2: the tensor-parallel step, with and without the stack
    "upipe, tp 2": [
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
    ],
    "upipe+tiling+offload, tp 2": [
        *JOBS["upipe+tiling"],
        *JOBS["upipe+offload"],
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
    ],
}


def _config(tmp: str, cp: int, extra: list[str]):
    return parse_args(
        [
            "--config",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            tmp,
            "--training.seq_len",
            str(512 * cp),
            "--training.local_batch_size",
            "1",
            "--parallelism.context_parallel_degree",
            str(cp),
            "--checkpoint.enable",
            "false",
            "--metrics.enable_tensorboard",
            "false",
            *extra,
        ]
    )


def _real_peaks(rank: int, world: int, tmp: str, jobs: dict, out: str) -> None:
    peaks = {}
    for name, extra in jobs.items():
        config = _config(tmp, world, extra)
        tracker = LiveMemoryTracker()
        with transparent_ops(), tracker:
            trainer = Trainer(config)
            tracked_step(trainer, tracker, config)
        peak = torch.tensor(float(tracker.peaks["cpu"].bytes))
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        peaks[name] = peak.item()
        del trainer
    if rank == 0:
        Path(out).write_text(json.dumps(peaks))


STACK = [  # the recipes' memory stack, with tiles and chunks that do not divide the shard
    *JOBS["upipe+offload"],
    "--memory.tiled_mlp",
    "true",
    "--memory.mlp_tile_tokens",
    "100",
    "--memory.tiled_rms_norm",
    "true",
    "--memory.norm_tile_tokens",
    "96",
    "--memory.chunked_loss",
    "true",
    "--memory.loss_chunk_tokens",
    "120",
]
COMPILED_JOBS = {  # [compile] enable: inductor's graphs, planned by planning.compiled
    "upipe, compiled": [],  # untiled norms and SwiGLU: fused kernels, saved mm outputs
    "upipe + stack, compiled": STACK,
    "upipe + stack + documents, compiled": [
        *STACK,
        "--training.attention_mask",
        "document",
        "--training.position_ids",
        "document",
    ],
}


def _make_inductor_allocations_visible() -> None:
    """Inductor's generated code allocates with a function that does not dispatch, so no
    dispatch mode sees it; in this process it calls ``torch.empty_strided`` instead (same
    memory), which the tracker sees like any other allocation."""
    torch._C._dynamo.guards._empty_strided_cpu = lambda size, stride, dtype: torch.empty_strided(
        size, stride, dtype=dtype, device="cpu"
    )


def _real_compiled_peaks(rank: int, world: int, tmp: str, jobs: dict, out: str) -> None:
    """The compiled job's tracked step, as ``_real_peaks`` does, then two more steps on other
    tokens (documents that end elsewhere): dynamo must compile nothing after the first."""
    _make_inductor_allocations_visible()
    results = {}
    for name, extra in jobs.items():
        torch._dynamo.reset()
        config = _config(tmp, world, [*extra, "--compile.enable", "true"])
        tracker = LiveMemoryTracker()
        with transparent_ops(), tracker:  # steps 2 and 3 too: ops run as in step 1
            trainer = Trainer(config)
            tracked_step(trainer, tracker, config)
            peak = torch.tensor(float(tracker.peaks["cpu"].bytes))
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            generator = torch.Generator().manual_seed(rank)
            for _ in range(2):
                tokens = torch.randint(0, 2048, (1, config.training.seq_len), generator=generator)
                trainer.train_step([(tokens, tokens)])
            recompiles = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        results[name] = (peak.item(), recompiles)
        del trainer
    if rank == 0:
        Path(out).write_text(json.dumps(results))


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_compiled_plan_predicts_real_compiled_peak(tmp_path: Path, cp: int) -> None:
    """A compiled job's plan is the compiled step's (planning.compiled), within 5% of the real
    compiled step's peak (inductor's code running on CPU); and three steps compile once."""
    out = tmp_path / "real.json"
    run_on_ranks(cp, _real_compiled_peaks, str(tmp_path), COMPILED_JOBS, str(out))
    real = json.loads(out.read_text())
    errors = {}
    for name, extra in COMPILED_JOBS.items():
        plan = plan_job(
            _config(str(tmp_path), cp, [*extra, "--compile.enable", "true"]), target="cpu"
        )
        assert plan.compiled
        peak, recompiles = real[name]
        assert recompiles == 0, f"{name}: {recompiles} graphs compiled after the first step"
        errors[name] = (plan.device_peak_bytes, peak, abs(plan.device_peak_bytes - peak) / peak)
    print(f"cp {cp}: planned / real compiled peak bytes: {json.dumps(errors)}")
    bad = {k: v for k, v in errors.items() if not v[2] <= 0.05}
    assert not bad, f"planned vs real compiled peak bytes (relative error): {bad}"


def test_plans_sharing_compiled_graphs_are_the_plans_compiled_afresh() -> None:
    """Inside ``shared_compiles`` (a search) a plan reuses the graphs that plans before it
    compiled: another head stage size compiles fewer graphs, the same settings none, and each plan
    holds the bytes and time of the same plan compiled afresh."""
    configs = [
        parse_args(
            [
                "--config",
                str(REPO / "train_configs/debug_model.toml"),
                "--compile.enable",
                "true",
                "--activation_checkpoint.mode",
                "full",
                "--activation_checkpoint.cpu_offload",
                "true",
                "--parallelism.heads_per_stage",
                str(heads),
            ]
        )
        for heads in (2, 4, 2)
    ]
    fresh = [plan_job(config) for config in configs]
    shared, compiled = [], []
    with shared_compiles():
        for config in configs:
            shared.append(plan_job(config))
            compiled.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - sum(compiled))
    assert 0 < compiled[1] < compiled[0] and compiled[2] == 0, compiled

    def numbers(plan):
        return (
            plan.device_peak_bytes,
            plan.device_breakdown,
            plan.host_peak_bytes,
            plan.speed.step_time_s,
        )

    assert [numbers(plan) for plan in shared] == [numbers(plan) for plan in fresh]


@pytest.mark.parametrize("cp", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_planner_predicts_real_peak_within_5_percent(tmp_path: Path, cp: int) -> None:
    """Every style and stack on ``cp`` ranks (on 4: also as cp 2 x tp 2)."""
    jobs = JOBS | (TP_JOBS if cp == 4 else {})
    out = tmp_path / "real.json"
    run_on_ranks(cp, _real_peaks, str(tmp_path), jobs, str(out))
    real = json.loads(out.read_text())
    errors = {}
    for name, extra in jobs.items():
        planned = plan_job(_config(str(tmp_path), cp, extra), target="cpu").device_peak_bytes
        errors[name] = (planned, real[name], abs(planned - real[name]) / real[name])
    print(
        f"cp {cp}: planned / real peak bytes: {json.dumps(errors)}"
    )  # the README's table (pytest -s -n 0)
    bad = {k: v for k, v in errors.items() if not v[2] <= 0.05}
    assert not bad, f"planned vs real peak bytes (relative error): {bad}"


def test_plan_reports_breakdown_and_fit(tmp_path: Path) -> None:
    config = _config(str(tmp_path), 2, JOBS["ulysses+all"])
    plan = plan_job(config, Budget(device_bytes=8 * GiB))
    assert plan.fits and plan.device_peak_bytes > 0 and plan.host_peak_bytes > 0
    assert sum(plan.device_breakdown.values()) == plan.device_peak_bytes
    # A GPU plan adds what CUDA holds outside the step: context, NCCL (default, FSDP and the cp
    # all-to-all group), cuBLAS workspace and a fragmentation margin.
    allowances = CudaAllowances()
    assert plan.device_breakdown[CUDA_CONTEXT] == allowances.context_bytes
    assert (
        plan.device_breakdown[f"{NCCL_BUFFERS} (3 communicators)"]
        == 3 * allowances.nccl_bytes_per_communicator
    )
    cpu_plan = plan_job(config, Budget(device_bytes=8 * GiB), target="cpu")
    assert CUDA_CONTEXT not in cpu_plan.device_breakdown
    assert not plan_job(config, Budget(device_bytes=plan.device_peak_bytes - 1)).fits
    assert "block" in plan.device_peak_when or "head" in plan.device_peak_when


def test_an_expert_parallel_plan_prices_its_exchanges_and_syncs(tmp_path: Path) -> None:
    """Expert parallelism's token exchanges are their own row of the step time (not the heads'
    all-to-all, whose group they share at cp 4 x ep 2), each MoE block reads its token counts
    on the host once, and its two communicators (ep, the experts' FSDP) are allowed for; the
    busiest rank of a skewed router (``expert_load``) holds and waits for more."""
    config = _config(str(tmp_path), 4, JOBS["qwen3-moe, ep 2"])
    plan = plan_job(config)
    assert "experts over 2 ranks" in plan.render()
    exchanges = plan.speed.time_breakdown_s["exposed expert all-to-all"]
    assert exchanges > 0 and plan.speed.time_breakdown_s["exposed head all-to-all"] > 0
    assert plan.host_syncs_per_step == plan.n_layers  # no recompute in the debug job
    assert f"{NCCL_BUFFERS} (5 communicators)" in plan.device_breakdown
    busiest = plan_job(config, expert_load=2)  # its experts get twice their even share
    assert "receiving 2x their even share" in busiest.render()
    assert busiest.experts_high_bytes > plan.experts_high_bytes
    assert busiest.speed.time_breakdown_s["exposed expert all-to-all"] > exchanges


def test_a_tiled_moe_plan_shows_its_buffers_untiled_too(tmp_path: Path, capsys) -> None:
    """What tiling the MoE blocks buys, in the plan itself: their buffers planned again untiled."""
    config = ["--config", str(REPO / "train_configs/qwen3_moe_debug.toml")]
    tiled = ["--memory.tiled_mlp", "true", "--memory.mlp_tile_tokens", "64"]
    assert plan_cli.main([*config, *tiled, "--json", "--job.dump_folder", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["untiled_moe"]["experts_high_bytes"] > 2 * report["experts_high_bytes"] > 0
    assert plan_cli.main([*config, "--json", "--job.dump_folder", str(tmp_path)]) == 0
    assert "untiled_moe" not in json.loads(capsys.readouterr().out)  # nothing tiled: no line


def test_cli_json_and_sweep(tmp_path: Path) -> None:
    base = [
        sys.executable,
        "-m",
        "upipe_dtensor.plan",
        "--config",
        str(REPO / "train_configs/debug_model.toml"),
    ]
    # a compiled job plans its compiled graphs and says so
    result = subprocess.run(
        [*base, "--json", "--compile.enable", "true"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"device_peak_bytes", "host_peak_bytes", "device_breakdown", "budget", "fits"} <= set(
        report
    )
    assert report["compiled"] is True
    assert report["longest_context"]["how"] == "estimated"
    assert report["longest_context"]["tokens"] > report["seq_len"]  # 0.1 GiB of 80 GiB

    budget = ["--device-memory-gib", "3.2", "--resolution", "0.2", "--json"]
    searched = subprocess.run(
        [*base, "--longest", *budget], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert searched.returncode == 0, searched.stderr
    longest_here = json.loads(searched.stdout)["longest_context"]
    assert longest_here["how"] == "searched"

    sweep = subprocess.run(
        [
            *base,
            "--sweep",
            "seq_len",
            "--styles",
            "upipe,ulysses",
            "--out",
            str(tmp_path),
            *budget,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert sweep.returncode == 0, sweep.stderr
    longest = json.loads(sweep.stdout)["max_seq_len"]
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    for style in ("upipe", "ulysses"):
        fitting = [
            int(r["seq_len"]) for r in rows if r["cp_style"] == style and r["fits"] == "True"
        ]
        failing = [
            int(r["seq_len"]) for r in rows if r["cp_style"] == style and r["fits"] == "False"
        ]
        assert longest[style] == max(fitting) and min(failing) > longest[style]
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    assert longest_here["tokens"] == longest["upipe"]  # the job's own style, searched alike


SHORTCUTS = {  # on fake tensors: loops of >= 4 identical iterations run their first two and last
    "tiles": [
        "--training.seq_len",
        str(4 * 16384),  # four tiles of each kind (RoPE's are 16384 tokens)
        "--memory.mlp_tile_tokens",
        "16384",
        "--memory.norm_tile_tokens",
        "16384",
        "--memory.loss_chunk_tokens",
        "16384",
        "--parallelism.context_parallel_degree",
        "1",
        "--memory.tiled_mlp",
        "true",
        "--memory.tiled_rms_norm",
        "true",
        "--memory.chunked_loss",
        "true",
    ],
    # 8 chunks: 36 query/key chunk pairs per stage; one stage of all heads, as published
    "fpdt": [
        "--training.seq_len",
        "16384",
        "--parallelism.cp_style",
        "fpdt",
        "--parallelism.chunk_tokens",
        "2048",
    ],
    # UPipe x FPDT: KV blocks shared by several stages (partial dK/dV parked between them)
    "upipe x fpdt": ["--training.seq_len", "16384", "--parallelism.chunk_tokens", "2048"],
}


@pytest.mark.parametrize(
    "loops",
    # UPipe x FPDT (about 100 s: every chunk pair of every stage) runs with --slow; FPDT's chunk
    # pairs and the tiles check the shortcut itself in every run.
    [
        pytest.param(name, marks=pytest.mark.slow) if name == "upipe x fpdt" else name
        for name in SHORTCUTS
    ],
    ids=list(SHORTCUTS),
)
def test_planning_visits_a_few_iterations_and_plans_the_same(
    tmp_path: Path, monkeypatch, loops: str
) -> None:
    """The tiled ops (MLP, RMSNorm, RoPE, loss; memory/tiling.py) and FPDT's chunk-pair loops plan
    the same device and host memory with the planner's shortcut as with every iteration, and the
    step-time model counts the same work (FLOPs, bytes, calls) from the iterations it visits."""
    config = parse_args(
        [
            "--config",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            str(tmp_path),
            "--training.local_batch_size",
            "1",
            "--activation_checkpoint.mode",
            "full",
            "--activation_checkpoint.cpu_offload",
            "true",
            *SHORTCUTS[loops],
        ]
    )
    shortcut = plan_job(config)
    monkeypatch.setattr(loop_modes, "_every_tile_when_planning", True)
    every_iteration = plan_job(config)
    assert shortcut.device_peak_bytes == every_iteration.device_peak_bytes
    assert shortcut.device_breakdown == every_iteration.device_breakdown
    assert shortcut.host_peak_bytes == every_iteration.host_peak_bytes
    assert shortcut.speed.work.keys() == every_iteration.speed.work.keys()
    for key, value in every_iteration.speed.work.items():
        assert shortcut.speed.work[key] == pytest.approx(value, rel=1e-9), key


@pytest.mark.parametrize(
    "recipe,world,gib",
    [
        ("llama3_8b_5M", 8, 80),
        pytest.param("llama3_8b_8M", 8, 80, marks=pytest.mark.slow),
        pytest.param("llama3_32b_6M", 16, 80, marks=pytest.mark.slow),
        pytest.param("multinode/llama3_8b_2d_16gpu_11M", 16, 80, marks=pytest.mark.slow),
        pytest.param("llama3_8b_h200_13M", 8, 140, marks=pytest.mark.slow),
    ],
)
def test_headline_recipes_fit_their_gpus_and_2_tib_nodes(recipe: str, world: int, gib: int) -> None:
    """The long-context claims, CUDA allowances included: 8B at 5M and 8M on one node of 8 x 80 GiB,
    the 32B shape at 6M on 16, 8B at 11M on 16 with the 2D (ring x heads) layout, 8B at 13M on
    one node of 8 H200s."""
    budget = Budget(device_bytes=gib * GiB)  # 2 TiB host per node of 8
    plan = plan_job(parse_args(["--config", str(REPO / f"recipes/{recipe}.toml")]), budget)
    assert plan.world_size == world
    assert plan.fits, plan.render()
