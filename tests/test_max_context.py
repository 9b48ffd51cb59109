"""``plan --max-context`` and the sequence-length search under it (and under ``--sweep seq_len``).

The search is checked against a brute-force scan of memory curves whose limits are known; the
found contexts are checked by planning them again (and one step of 1024 tokens per GPU more) from
the printed recipe, as a user would.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from upipe_dtensor import plan as plan_cli
from upipe_dtensor.config import ConfigError, parse_args
from upipe_dtensor.planning.length_search import GRANULE_TOKENS_PER_RANK, longest_fitting, tolerance
from upipe_dtensor.planning.max_context import (
    KNOB_NAMES,
    SEARCH_NAMES,
    find_max_context,
    knobs,
    on_world,
)
from upipe_dtensor.planning.step import Budget, Plan, plan_job

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
CHECKPOINTED = [
    "--activation_checkpoint.mode",
    "full",
    "--activation_checkpoint.cpu_offload",
    "true",
    "--training.local_batch_size",
    "1",
]


def _curve_plan(device, host, budget: Budget, fixed: int):
    """Plans whose memory follows the given curves of seq_len."""

    def plan_at(seq_len: int) -> Plan:
        peak = int(device(seq_len))
        return Plan(
            None,
            seq_len,
            "upipe",
            8,
            "UPipe",
            "cuda",
            "sdpa",
            8,
            peak,
            "synthetic",
            {"parameters + gradients + optimizer state": fixed, "other": peak - fixed},
            0,
            int(host(seq_len)),
            budget,
        )

    return plan_at


CURVES = {  # peak device bytes, host bytes per node
    "linear": (lambda s: 6 * GiB + 7000 * s, lambda s: 300_000 * s),
    "convex": (lambda s: 6 * GiB + 5000 * s + (s / 1e6) ** 2 * GiB, lambda s: 100 * s),
    "concave": (lambda s: 6 * GiB + 40 * GiB * math.sqrt(s / 5e6), lambda s: 100 * s),
    "host-bound": (lambda s: 6 * GiB + 1000 * s, lambda s: 400_000 * s),
    "steps": (lambda s: 6 * GiB + (s // 500_000) * 4 * GiB, lambda s: 0),
}


@pytest.mark.parametrize("resolution", [0.0, 0.03])
def test_length_search_finds_the_limit_of_known_curves(resolution: float) -> None:
    budget, granule = Budget(device_bytes=80 * GiB, host_bytes_per_node=2048 * GiB), 8192
    for name, (device, host) in CURVES.items():

        def fits(s: int, device=device, host=host) -> bool:
            return device(s) <= budget.device_bytes and host(s) <= budget.host_bytes_per_node

        limit = granule
        while fits(limit + granule):
            limit += granule
        for start in (granule, 5 * 2**20, 64 * 2**20):
            found, plans = longest_fitting(
                _curve_plan(device, host, budget, 6 * GiB),
                budget,
                start=start,
                granule=granule,
                resolution=resolution,
            )
            assert fits(found) and found <= limit, (name, start, found, limit)
            assert limit - found < tolerance(found, granule, resolution), (
                name,
                start,
                found,
                limit,
            )
            assert any(
                p.seq_len > found
                and not p.fits
                and p.seq_len - found <= tolerance(found, granule, resolution)
                for p in plans
            ), "the answer is confirmed by a failing plan just above it"
            if name == "linear" and start == 5 * 2**20:
                assert len(plans) <= 4, [p.seq_len for p in plans]  # doubling + bisection took ~10


def _max_context_json(tmp_path: Path, capsys, *args: str, recipe: str = "debug_model.toml") -> dict:
    """Run ``plan --max-context --json`` on a copy of the debug config in tmp_path (so the printed
    recipe can be saved next to it), or on ``recipe`` there, and return the report."""
    shutil.copy(REPO / "train_configs/debug_model.toml", tmp_path / "debug_model.toml")
    code = plan_cli.main(
        ["--config", str(tmp_path / recipe), "--max-context", "--json", *CHECKPOINTED, *args]
    )
    assert code == 0
    return json.loads(capsys.readouterr().out)


def _check_printed_recipe(tmp_path: Path, report: dict) -> None:
    """The printed TOML loads, plans to the printed peak and fits; one granule more does not."""
    saved = tmp_path / "found.toml"
    saved.write_text(report["recipe_toml"])
    config = parse_args(["--config", str(saved)])
    budget = Budget(**report["plan"]["budget"])
    again = plan_job(config, budget)
    assert config.training.seq_len == report["seq_len"]
    assert again.device_peak_bytes == report["plan"]["device_peak_bytes"] and again.fits
    assert again.host_per_node_bytes == report["plan"]["host_per_node_bytes"]
    granule = GRANULE_TOKENS_PER_RANK * config.parallelism.context_parallel_degree
    longer = parse_args(
        ["--config", str(saved), "--training.seq_len", str(report["seq_len"] + granule)]
    )
    assert not plan_job(longer, budget).fits


def test_max_context_device_bound(tmp_path: Path, capsys) -> None:
    report = _max_context_json(
        tmp_path,
        capsys,
        "--device-memory-gib",
        "3.15",
        "--search",
        "heads_per_stage,fsdp_cpu_offload",
    )
    _check_printed_recipe(tmp_path, report)
    assert set(report["settings"]) == {"heads_per_stage", "fsdp_cpu_offload"}
    assert report["not_searched"]["block_input_prefetch"] == "not in --search"
    assert report["plan"]["device_peak_bytes"] > report["plan"]["host_per_node_bytes"]


def test_max_context_on_two_nodes_prints_a_2d_recipe_without_sequence_chunks(
    tmp_path: Path, capsys
) -> None:
    """More GPUs than a node runs UPipe in 2D; the recipe's sequence chunks (which a ring axis
    does not take) are switched off in the printed recipe, which loads (its keys set once: the
    dump folder too), fits, and is the limit."""
    (tmp_path / "chunked.toml").write_text(
        'extends = "debug_model.toml"\n[job]\ndump_folder = "out"\n'
        "[parallelism]\nchunk_tokens = 2048\n"
    )
    report = _max_context_json(
        tmp_path,
        capsys,
        "--device-memory-gib",
        "3.15",
        "--world-size",
        "4",
        "--gpus-per-node",
        "2",
        "--search",
        "heads_per_stage",
        recipe="chunked.toml",
    )
    _check_printed_recipe(tmp_path, report)
    recipe = report["recipe_toml"]
    assert "ring_degree = 2" in recipe and "\nchunk_tokens" not in recipe
    assert 'extends = "debug_model.toml"' in recipe  # the chunked file's base: its chunks unset
    assert "sequence chunks do not combine with a ring" in report["not_searched"]["sequence_chunks"]


@pytest.mark.slow  # ~1 min; relaxing toward faster settings also runs in the objective-speed test
def test_max_context_relaxes_to_faster_settings_when_the_device_has_room(
    tmp_path: Path, capsys
) -> None:
    """Host RAM binds (block inputs offloaded), so the device has room at the longest context:
    FSDP CPU offload goes (it costs host RAM), and U and the prefetch relax to their fastest."""
    report = _max_context_json(
        tmp_path,
        capsys,
        "--device-memory-gib",
        "40",
        "--host-memory-gib",
        "0.2",
        "--search",
        "heads_per_stage,fsdp_cpu_offload,block_input_prefetch",
    )
    _check_printed_recipe(tmp_path, report)
    assert report["settings"] == {
        "heads_per_stage": 8,
        "fsdp_cpu_offload": False,
        "block_input_prefetch": True,
    }
    tried = [p for p in report["plans"] if p["seq_len"] == report["seq_len"]]
    assert any(p["settings"]["heads_per_stage"] == 2 for p in report["plans"])  # started at U = C
    assert all(p["fits"] for p in tried[-3:])  # the relaxation steps were planned and fit


def test_objective_speed_keeps_the_length_and_takes_the_fastest_settings_that_fit(
    tmp_path: Path, capsys
) -> None:
    """At the recipe's own length: U from C up to every head (fewer all-to-all calls), each step
    kept only where the step-time model predicts it no slower; the printed recipe loads."""
    shutil.copy(REPO / "train_configs/debug_model.toml", tmp_path / "debug_model.toml")
    args = ["--config", str(tmp_path / "debug_model.toml"), "--objective", "speed", "--json"]
    assert plan_cli.main([*args, *CHECKPOINTED, "--search", "heads_per_stage"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["objective"] == "speed" and report["seq_len"] == 512
    speeds = {p["settings"]["heads_per_stage"]: p["tokens_per_s_per_gpu"] for p in report["plans"]}
    assert report["settings"]["heads_per_stage"] == max(speeds, key=speeds.get)
    assert "The fastest settings the planner finds" in report["recipe_toml"]
    saved = tmp_path / "fastest.toml"
    saved.write_text(report["recipe_toml"])
    assert parse_args(["--config", str(saved)]).parallelism.options.heads_per_stage == max(
        speeds, key=speeds.get
    )


def test_objective_speed_keeps_attention_in_as_many_blocks_as_fit() -> None:
    """Where every block's kept attention would not fit the device (and none fits the host), the
    speed search keeps it on the device in the last blocks, as many as fit (``kept_layers``)."""

    def config(*extra: str):
        recipe = str(REPO / "train_configs/debug_model.toml")
        return parse_args(["--config", recipe, "--training.seq_len", "4096", *CHECKPOINTED, *extra])

    recomputed = plan_job(config())
    kept = plan_job(config("--activation_checkpoint.keep_attention", "device"))
    per_block = (kept.device_peak_bytes - recomputed.device_peak_bytes) / 4  # 4 blocks
    budget = Budget(
        device_bytes=int(recomputed.device_peak_bytes + 2.5 * per_block),
        host_bytes_per_node=recomputed.host_per_node_bytes,
    )
    found = find_max_context(
        config(), budget, search=["keep_attention", "kept_layers"], objective="speed"
    )
    skip = found.config.activation_checkpoint.keep_attention_skip_first
    assert found.settings["keep_attention"] == "device" and 0 < skip < 4
    assert found.plan.fits and found.plan.speed.step_time_s < recomputed.speed.step_time_s
    one_more = [
        plan
        for settings, plan in found.plans
        if settings == {"keep_attention": "device", "kept_layers": skip - 1}
    ]
    assert one_more and not one_more[0].fits


def test_knobs_follow_the_layout() -> None:
    """Which settings apply where, and that a chosen chunk count is a valid configuration."""
    config_args = [
        "--config",
        str(REPO / "train_configs/debug_model.toml"),
        "--training.seq_len",
        "8192",
        *CHECKPOINTED,
        "--memory.chunked_loss",
        "true",
    ]
    config = parse_args(config_args)
    one_node = knobs(on_world(config, 2, gpus_per_node=8))
    assert list(one_node) == list(KNOB_NAMES)
    chunks, heads = one_node["sequence_chunks"], one_node["heads_per_stage"]
    assert chunks.values == (8, 4, 2, 1) and heads.values == (2, 4, 8)
    assert chunks.apply(config, 4).parallelism.options.chunk_tokens == 2048
    assert one_node["blocks_per_checkpoint"].values == (
        2,
        1,
    )  # pairs save host memory, one is faster
    assert (
        one_node["blocks_per_checkpoint"]
        .apply(config, 2)
        .activation_checkpoint.blocks_per_checkpoint
        == 2
    )
    assert one_node["tile_sizes"].keys == ("memory.loss_chunk_tokens",)
    assert (
        one_node["tile_sizes"].apply(config, 4).memory.loss_chunk_tokens
        == config.memory.loss_chunk_tokens // 4
    )
    two_nodes = on_world(config, 4, gpus_per_node=2)
    assert (
        two_nodes.parallelism.ring_degree == 2
        and two_nodes.parallelism.context_parallel_degree == 4
    )
    assert isinstance(knobs(two_nodes)["sequence_chunks"], str)  # no chunks on a ring across nodes
    tp2 = on_world(
        parse_args([*config_args, "--parallelism.tensor_parallel_degree", "2"]), 4, gpus_per_node=8
    )
    assert (tp2.parallelism.context_parallel_degree, tp2.parallelism.tensor_parallel_degree) == (
        2,
        2,
    )
    assert knobs(tp2)["heads_per_stage"].values == (2, 4)  # U among a tp rank's 4 of the 8 heads
    ulysses = knobs(
        on_world(
            parse_args(
                [
                    "--config",
                    str(REPO / "train_configs/debug_model.toml"),
                    "--parallelism.cp_style",
                    "ulysses",
                ]
            ),
            2,
            gpus_per_node=8,
        )
    )
    assert "cp_style is 'ulysses'" in ulysses["heads_per_stage"]
    assert "not offloaded" in ulysses["blocks_per_checkpoint"]  # the debug job keeps block inputs


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-context", "--search", "heads,tiles"], "choose from " + ", ".join(SEARCH_NAMES)),
        (["--search", "heads_per_stage"], "--search applies to --max-context"),
        (["--max-context", "--sweep", "seq_len"], "not allowed with argument"),
        (["--max-context", "--styles", "upipe"], "--styles applies to --sweep"),
    ],
)
def test_bad_options_name_the_choices(args: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main(["--config", str(REPO / "train_configs/debug_model.toml"), *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_settings_that_cannot_apply_are_config_errors() -> None:
    config = parse_args(["--config", str(REPO / "train_configs/debug_model.toml")])
    with pytest.raises(
        ConfigError,
        match=r"do not split over 3 ranks; world sizes that work for this model: 1, 2, 4, 8",
    ):
        find_max_context(config, Budget(), world_size=3)
    ulysses = parse_args(
        [
            "--config",
            str(REPO / "train_configs/debug_model.toml"),
            "--parallelism.cp_style",
            "ulysses",
        ]
    )
    with pytest.raises(
        ConfigError,
        match=r"--search sequence_chunks: does not apply here .*searchable now: fsdp_cpu_offload",
    ):
        find_max_context(ulysses, Budget(), world_size=2, search=["sequence_chunks"])


def test_tensor_parallel_is_searched_around_the_other_settings(tmp_path: Path, capsys) -> None:
    """``--search tensor_parallel`` runs the search once per degree that divides a node (each on
    its own layout: cp = world / tp), keeps the longest (then the fastest), says what every
    degree reached or why it could not run, and prints a recipe that plans as reported."""
    report = _max_context_json(
        tmp_path,
        capsys,
        "--device-memory-gib",
        "3.15",
        "--world-size",
        "4",
        "--gpus-per-node",
        "4",
        "--search",
        "tensor_parallel",
    )
    found = report["by_tensor_parallel"]
    assert set(found) == {"1", "2", "4"}
    ran = {int(tp): r for tp, r in found.items() if isinstance(r, dict)}
    assert len(ran) >= 2, found
    best = max(ran, key=lambda tp: (ran[tp]["seq_len"], ran[tp]["tokens_per_s_per_gpu"]))
    assert report["settings"]["tensor_parallel"] == best
    assert report["seq_len"] == ran[best]["seq_len"]
    assert f"tensor_parallel_degree = {best}" in report["recipe_toml"]
    _check_printed_recipe(tmp_path, report)
