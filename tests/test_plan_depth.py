"""A plan traced on a reduced-depth model (``planning/depth.py``, ``planning/timeline.py``), its
attention computations replayed where they repeat (``planning/replay.py``), is the full trace's
(every block traced, every computation run), to the byte: peak device and host bytes, what
holds the peak and when, the counted work, the rehearsal's syncs and collectives, the predicted
times.

The reference is ``plan_job(..., full_trace=True)``, which traces every block. In every run:
shipped recipes with their model cut to 7-11 blocks, deep enough that runs of alike blocks are
shortened (the inserted copies stand for the rest), one per model size (Llama3-8B, the 32B
shape, Qwen3-8B and -32B), per style family (UPipe, Ulysses, ring, FPDT, UPipe x FPDT, 2D) and
per stack (the base stack with device-kept attention and prefetch, the long stack with
host-kept attention in the last blocks and FSDP CPU offload, checkpoint pairs, 2D), plus a CPU
plan and two micro-batches. With ``--slow``: every shipped recipe at its own depth (minutes
each).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch.distributed as dist
from harness import llama_31_8b_folder

from upipe_dtensor.config import parse_args
from upipe_dtensor.models import get_family
from upipe_dtensor.planning.depth import DepthReduction, reduce_depth
from upipe_dtensor.planning.replay import ComputationReplay
from upipe_dtensor.planning.step import Budget, GiB, Plan, plan_job
from upipe_dtensor.planning.timeline import StepTimeline, expand
from upipe_dtensor.planning.tracker import Peak

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
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


JOBS = {  # name: (shipped recipe, blocks it is cut to, planner target, overrides)
    # Llama3-8B, UPipe with stages in turn, the long stack: host-kept attention in the last
    # blocks, FSDP CPU offload, no block-input prefetch (2M-5M)
    "8B 5M: upipe, host-kept last blocks, FSDP offload": (
        "recipes/llama3_8b_5M.toml",
        11,
        "cuda",
        ["--activation_checkpoint.keep_attention_skip_first", "5"],
    ),
    # the 32B shape, UPipe x FPDT in checkpoint pairs (8M, 32B 6M, H200 13M), at 4M: two of
    # the recipe's 2M-token chunks (each chunk pair is more work to trace)
    "32B 6M at 4M: upipe x fpdt, pairs": (
        "recipes/llama3_32b_6M.toml",
        10,
        "cuda",
        ["--training.seq_len", "4194304"],
    ),
    # 2D: a ring of two head groups, on the long stack, attention recomputed
    "8B 2D 11M: 2d": ("recipes/multinode/llama3_8b_2d_16gpu_11M.toml", 8, "cuda", []),
    # Qwen3-32B (QK-norm, 8 KV heads on 16 ranks) with Ulysses on the 32B long stack
    "qwen3 32B 4M: ulysses, host-kept last blocks": (
        "recipes/qwen3_32b_4M.toml",
        10,
        "cuda",
        [
            "--parallelism.cp_style",
            "ulysses",
            "--activation_checkpoint.keep_attention_skip_first",
            "4",
        ],
    ),
    # the FPDT baselines (one 64K-token chunk pair at 128K)
    "8B 128K: fpdt, device-kept": ("recipes/baselines/llama3_8b_fpdt_128K.toml", 7, "cuda", []),
    # Qwen3-8B with ring attention on the base stack (128K-1M: attention kept on the device,
    # block-input prefetch), as the ring baselines run; a CPU plan, two micro-batches
    "qwen3 8B 1M: ring, device-kept, prefetch, cpu, micro-batches": (
        "recipes/qwen3_8b_1M.toml",
        8,
        "cpu",
        ["--parallelism.cp_style", "ring", "--training.gradient_accumulation_steps", "2"],
    ),
}


@pytest.mark.parametrize("job", list(JOBS))
def test_reduced_depth_plan_is_the_full_trace(monkeypatch, job: str) -> None:
    recipe, layers, target, extra = JOBS[job]
    config = parse_args(["--config", str(REPO / recipe), *extra])
    flavors = get_family(config.model.name).flavors
    flavor = config.model.flavor
    monkeypatch.setitem(flavors, flavor, dataclasses.replace(flavors[flavor], n_layers=layers))
    reduction = reduce_depth(config)
    assert reduction is not None and reduction.traced_layers < layers, job
    replayed = []
    play = ComputationReplay._play
    monkeypatch.setattr(
        ComputationReplay, "_play", lambda self, *a: replayed.append(1) or play(self, *a)
    )
    fast = plan_job(config, target=target)
    assert replayed, "no attention computation was replayed"
    assert_same_plan(fast, plan_job(config, target=target, full_trace=True))


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
def test_every_recipe_plans_as_its_full_trace(recipe: str, tmp_path: Path) -> None:
    extra = []  # context extension starts from Hugging Face Llama-3.1-8B weights
    if "extend" in recipe:
        extra = ["--model.hf_assets_path", llama_31_8b_folder(tmp_path / "Llama-3.1-8B")]
    config = parse_args(["--config", str(REPO / recipe), *extra])
    budget = Budget(device_bytes=140 * GiB, gpu="h200") if "h200" in recipe else None
    assert_same_plan(plan_job(config, budget), plan_job(config, budget, full_trace=True))


def test_inserted_periods_peak_where_every_copy_would() -> None:
    """``timeline.expand`` against the copies played one by one: a forward period that leaves
    memory behind (its highest copy is the last) and a backward one that frees more than it
    allocates (its highest copy is the first), each inserted three times. The peak, when it
    happens and what holds it are those of the step played out copy by copy."""
    reduction = DepthReduction(
        config=parse_args(["--config", str(REPO / "train_configs/debug_model.toml")]),
        n_layers=6,
        traced_layers=3,
        unit_blocks=1,
        full_units=(0, 1, 5),
        copies={("forward", 1): 3, ("backward", 2): 3},
        stand_ins=(),
    )
    periods = [  # (when, [(label, bytes)]): the traced step, block by block
        ("forward, block 0", [("act", 40), ("tmp", 30), ("tmp", -30)]),
        ("forward, block 1", [("act", 40), ("tmp", 25), ("tmp", -25)]),
        ("forward, block 2", [("act", 40), ("tmp", 10), ("tmp", -10)]),
        ("backward (recompute), block 2", [("tmp", 60), ("tmp", -60), ("act", -40)]),
        ("backward (recompute), block 1", [("tmp", 60), ("tmp", -60), ("act", -40)]),
        ("backward (recompute), block 0", [("tmp", 20), ("tmp", -20), ("act", -40)]),
    ]
    for forward_tmp in (25, 200):  # the peak inside the copied forwards, or in backward
        periods[1] = (
            "forward, block 1",
            [("act", 40), ("tmp", forward_tmp), ("tmp", -forward_tmp)],
        )
        timeline = StepTimeline()
        timeline.begin("setup", {"cpu": 100}, {"cpu": {"states": 100}})
        played = []  # the full step's phases, copies written out
        for when, events in periods:
            timeline.phase(when)
            timeline.events.extend(("cpu", label, n) for label, n in events)
            key = reduction.period_of(when)
            phase = key[0] if key is not None else None
            played.append((reduction.rename(when), events))
            for copy in range(reduction.copies.get(key, 0)):
                played.append((reduction.rename(when, phase, copy), events))
        timeline.end()
        total, labels = 100, {"states": 100}
        expected = Peak(total, "setup", dict(labels))
        for when, events in played:
            for label, n in events:
                total += n
                labels[label] = labels.get(label, 0) + n
                if total > expected.bytes:
                    expected = Peak(total, when, dict(labels))
        got = expand(timeline, reduction).peaks["cpu"]
        assert (got.bytes, got.when) == (expected.bytes, expected.when)
        assert {k: v for k, v in got.by_label.items() if v} == {
            k: v for k, v in expected.by_label.items() if v
        }
