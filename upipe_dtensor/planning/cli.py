"""Planner CLI: will a recipe fit on its GPUs and in host RAM, and how fast will it run? Answered
on a laptop.

    python -m upipe_dtensor.plan --config recipes/llama3_8b_5M.toml
    python -m upipe_dtensor.plan --config recipes/llama3_8b_5M.toml --gpu h200 --json
    python -m upipe_dtensor.plan --config recipes/llama3_8b_1M.toml --objective speed
    python -m upipe_dtensor.plan --config recipes/llama3_8b_5M.toml --sweep seq_len \\
        --styles upipe,ulysses
    python -m upipe_dtensor.plan --config recipes/llama3_8b_5M.toml --max-context \\
        > recipes/llama3_8b_max.toml

Any ``--section.key value`` overrides the recipe as in train.py. ``--sweep seq_len`` finds, for
each CP style, the longest context that fits both budgets (``length_search``) and writes
``sweep.csv`` and ``sweep.png`` (device and host panels) to ``--out``; existing ones are refused
unless ``--overwrite``. Every answer says which memory binds: "does not fit (host memory)".
A budget below what any step needs before its first activation (CUDA's fixed allowances, the
model states) is refused in seconds, before any search (``floor``). ``--max-context`` also
searches the settings (U, sequence chunks, FSDP CPU offload, tile sizes, block-input prefetch;
``max_context``) and prints a recipe for the longest context with its plan; ``--objective speed``
searches the same settings for the fastest step that fits at the recipe's length. Every plan
carries a predicted step time, tokens/s per GPU and MFU on ``--gpu`` (``planning.step_time``). See
``upipe_dtensor.planning.step`` for what is modelled.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import shlex
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from upipe_dtensor.checkpointing.outputs import refuse_existing, writing_file
from upipe_dtensor.config import OVERRIDES_HELP, JobConfig, parse_args
from upipe_dtensor.config.schema import StyleOptionValues
from upipe_dtensor.errors import DoesNotFit
from upipe_dtensor.parallel.registry import STYLES, style_spec
from upipe_dtensor.planning.checkpoint_interval import interval_line, suggested_interval
from upipe_dtensor.planning.floor import refuse_impossible
from upipe_dtensor.planning.hardware import GPU_PROFILES
from upipe_dtensor.planning.length_search import (
    GRANULE_TOKENS_PER_RANK,
    estimated_longest,
    longest_fitting,
)
from upipe_dtensor.planning.max_context import (
    SEARCH_NAMES,
    find_max_context,
    limit_of,
    recipe_toml,
)
from upipe_dtensor.planning.step import Budget, GiB, Plan, plan_job
from upipe_dtensor.planning.step_time import StepTime
from upipe_dtensor.runtime.errors import run_main


def _with(config: JobConfig, *, seq_len: int, cp_style: str) -> JobConfig:
    """The recipe with another style and length: the recipe's own U, sequence chunks and ring
    axis stay only for the style it names; another style runs in its published form (Ulysses and
    FPDT with all heads per stage, FPDT with the paper's chunk; ring and FPDT without a ring
    axis)."""
    same = cp_style == config.parallelism.cp_style
    parallelism = dataclasses.replace(
        config.parallelism,
        cp_style=cp_style,
        style_options=config.parallelism.style_options if same else StyleOptionValues(),
        ring_degree=config.parallelism.ring_degree if style_spec(cp_style).options.ring_axis else 1,
    )
    training = dataclasses.replace(config.training, seq_len=seq_len)
    return dataclasses.replace(config, parallelism=parallelism, training=training)


def longest_context(
    config: JobConfig,
    cp_style: str,
    budget: Budget,
    world_size: int | None,
    log,
    resolution: float,
    full_trace: bool = False,
    known: Plan | None = None,
    expert_load: float = 1.0,
) -> tuple[int, list[Plan]]:
    """The longest seq_len (a multiple of 1024 * cp, to within ``resolution`` of itself) that
    fits, and every plan evaluated (``length_search``: a few secant steps from the recipe's
    length; ``known``: the recipe's own plan, made already)."""
    granule = GRANULE_TOKENS_PER_RANK * config.parallelism.context_parallel_degree

    def plan_at(seq_len: int) -> Plan:
        plan = plan_job(
            _with(config, seq_len=seq_len, cp_style=cp_style),
            budget,
            world_size,
            full_trace=full_trace,
            expert_load=expert_load,
        )
        log(
            f"  {cp_style:8s} {seq_len:>12,} tokens: {plan.device_peak_bytes / GiB:7.2f} GiB "
            f"device, {plan.host_per_node_bytes / GiB:8.1f} GiB host/node -> {plan.verdict}"
        )
        return plan

    return longest_fitting(
        plan_at,
        budget,
        start=config.training.seq_len,
        granule=granule,
        resolution=resolution,
        known=known,
    )


def untiled_experts_line(config: JobConfig, plan: Plan, args, budget: Budget) -> tuple[str, dict]:
    """For a mixture of experts whose MoE blocks run in tiles: their buffers' high-water mark
    planned again untiled, beside the tiled one (what tiling them buys); nothing otherwise."""
    if not (plan.experts_high_bytes and config.memory.tiled_mlp):
        return "", {}
    untiled = plan_job(
        config.with_values({"memory.tiled_mlp": False}),
        budget,
        args.world_size,
        full_trace=args.full_trace,
        expert_load=args.expert_load,
    )
    share = plan.experts_high_bytes / max(untiled.experts_high_bytes, 1)
    return (
        f"  untiled MoE blocks   : {untiled.experts_high_bytes / GiB:8.2f} GiB at most ([memory] "
        f"tiled_mlp = false, planned again: the step {untiled.device_peak_bytes / GiB:.2f} GiB, "
        f"{untiled.verdict}); tiled they hold {share:.0%} of it",
        {
            "experts_high_bytes": untiled.experts_high_bytes,
            "device_peak_bytes": untiled.device_peak_bytes,
        },
    )


def longest_context_line(config: JobConfig, plan: Plan, args, budget: Budget) -> tuple[str, dict]:
    """The longest context at the job's own settings, in words and as JSON: searched with plans
    (``--longest``) or, by default, estimated from the one plan made (``length_search``)."""
    granule = GRANULE_TOKENS_PER_RANK * config.parallelism.context_parallel_degree
    if not args.longest:
        tokens = estimated_longest(plan, budget, granule)
        if tokens is None:
            return "", {"tokens": None, "how": "estimated"}
        return (
            f"  longest context      : about {tokens:,} tokens at these settings (on the line "
            "through this plan's fixed and growing memory; --longest plans it, --max-context "
            "searches the settings too)",
            {"tokens": tokens, "how": "estimated"},
        )
    resolution = SWEEP_RESOLUTION if args.resolution is None else args.resolution
    quiet = args.json
    tokens, plans = longest_context(
        config,
        config.parallelism.cp_style,
        budget,
        args.world_size,
        (lambda _: None) if quiet else (lambda line: print(line, file=sys.stderr, flush=True)),
        resolution,
        full_trace=args.full_trace,
        known=plan,
        expert_load=args.expert_load,
    )
    return (
        f"  longest context      : {tokens:,} tokens at these settings (searched with "
        f"{len(plans)} plans, to within {resolution:.0%}; --max-context searches the settings "
        "too)",
        {"tokens": tokens, "how": "searched", "plans": len(plans), "resolution": resolution},
    )


SWEEP_FILES = ("sweep.csv", "sweep.png")
SWEEP_RESOLUTION = 0.03
"""The longest context's precision in ``--sweep`` and ``--longest`` (a fraction of it)."""


def write_sweep(
    out: Path,
    results: dict[str, tuple[int, list[Plan]]],
    budget: Budget,
    title: str,
    *,
    overwrite: bool = False,
) -> None:
    """``sweep.csv`` (every plan, with which memory it exceeds) and ``sweep.png`` in ``out``,
    each written under a temporary name and renamed into place."""
    with writing_file(out / "sweep.csv", overwrite=overwrite) as temporary:
        _write_sweep_csv(temporary, results)
    with writing_file(out / "sweep.png", overwrite=overwrite) as temporary:
        plot_sweep(temporary, results, budget, title)


def _write_sweep_csv(path: Path, results: dict[str, tuple[int, list[Plan]]]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "cp_style",
                "seq_len",
                "device_peak_gib",
                "host_per_node_gib",
                "fits",
                "exceeds",
                "max_seq_len",
                "limited_by",
                "step_time_s",
                "tokens_per_s_per_gpu",
                "tokens_per_s_per_gpu_low",
                "tokens_per_s_per_gpu_high",
            ]
        )
        for style, (best, plans) in results.items():
            for plan in sorted(plans, key=lambda p: p.seq_len):
                writer.writerow(
                    [
                        style,
                        plan.seq_len,
                        f"{plan.device_peak_bytes / GiB:.3f}",
                        f"{plan.host_per_node_bytes / GiB:.1f}",
                        plan.fits,
                        plan.exceeds,
                        best,
                        limit_of(best, plans),
                        f"{plan.speed.step_time_s:.3f}" if plan.speed else "",
                        f"{plan.speed.tokens_per_s_per_gpu:.2f}" if plan.speed else "",
                        *(
                            [f"{end:.2f}" for end in plan.speed.tokens_per_s_per_gpu_range]
                            if plan.speed
                            else ["", ""]
                        ),
                    ]
                )


def plot_sweep(
    path: Path, results: dict[str, tuple[int, list[Plan]]], budget: Budget, title: str
) -> None:
    """Peak device memory per GPU and host memory per node against context length, one curve per
    style, each panel with its budget: a curve that stops below the GPU line is host-bound, and
    its legend says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (device, host) = plt.subplots(1, 2, figsize=(12, 4.5))
    for style, (best, plans) in results.items():
        points = sorted(plans, key=lambda p: p.seq_len)
        tokens = [p.seq_len / 2**20 for p in points]
        limit = limit_of(best, plans)
        label = f"{style} (max {best / 2**20:.2f}M" + (f", {limit} binds)" if limit else ")")
        (line,) = device.plot(
            tokens, [p.device_peak_bytes / GiB for p in points], marker="o", label=label
        )
        host_gib = [p.host_per_node_bytes / GiB for p in points]
        host.plot(tokens, host_gib, marker="o", color=line.get_color(), label=style)
    for axes, limit, what in (
        (device, budget.device_bytes, "peak device memory per GPU (GiB)"),
        (host, budget.host_bytes_per_node, "host memory per node (GiB)"),
    ):
        axes.axhline(limit / GiB, color="red", linestyle="--", label="budget")
        axes.set_xlabel("context length (M tokens)")
        axes.set_ylabel(what)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def sweep_title(config: JobConfig, world_size: int, budget: Budget) -> str:
    """The plot's title: the model, the GPUs and both memory budgets."""
    return (
        f"Planner: {config.model.name} {config.model.flavor} on {world_size} GPUs, "
        f"{budget.device_bytes / GiB:g} GiB "
        f"each, {budget.host_bytes_per_node / GiB:g} GiB host per node "
        f"({budget.gpus_per_node} GPUs per node)"
    )


def _positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a number of ``kind`` that must be > 0."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return value

    return parse


def _at_least_one(text: str) -> float:
    value = _positive(float)(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1 (1: even routing)")
    return value


def _fraction(text: str) -> float:
    value = _positive(float)(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{text} must be between 0 and 1 (e.g. 0.03 for 3%)")
    return value


def _names(kind: str, choices: Collection[str], example: str) -> Callable[[str], list[str]]:
    """A parser of comma-separated ``kind`` names, each one of ``choices`` (read when parsing:
    styles registered after import count), none twice."""

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",")]
        unknown = [name for name in names if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {kind} {', '.join(map(repr, unknown))}; choose from {', '.join(choices)} "
                f"(comma-separated, e.g. {example})"
            )
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"{text!r} names a {kind} twice")
        return names

    return parse


_styles = _names("cp style", STYLES, "upipe,ulysses")
_knobs = _names("setting", SEARCH_NAMES, "heads_per_stage,fsdp_cpu_offload")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=OVERRIDES_HELP,
    )
    parser.add_argument("--config", required=True, help="job or recipe .toml")
    parser.add_argument(
        "--gpu",
        choices=sorted(GPU_PROFILES),
        default="h100-sxm",
        help="the GPU kind whose hardware profile prices the step time (planning/hardware.py)",
    )
    parser.add_argument(
        "--device-memory-gib",
        type=_positive(float),
        default=None,
        help="memory per GPU (default: the --gpu's, 80 for h100-sxm, 140 for h200)",
    )
    parser.add_argument(
        "--host-memory-gib", type=_positive(float), default=2048.0, help="host RAM per node"
    )
    parser.add_argument("--gpus-per-node", type=_positive(int), default=8)
    parser.add_argument(
        "--world-size",
        type=_positive(int),
        default=None,
        help="ranks (default: cp degree x data_parallel_shard_degree)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--sweep", choices=["seq_len"], help="find the longest context that fits, per style"
    )
    mode.add_argument(
        "--max-context",
        action="store_true",
        help="search the settings for the longest context that fits; print its recipe and plan",
    )
    parser.add_argument(
        "--styles",
        type=_styles,
        default=None,
        help=f"cp styles to sweep, comma-separated, from: {', '.join(STYLES)} "
        "(default: upipe,ulysses)",
    )
    parser.add_argument(
        "--objective",
        choices=["length", "speed"],
        default=None,
        help="'speed': search the settings for the fastest step that fits at the recipe's "
        "seq_len (the step-time model decides) and print its recipe and plan; 'length' is "
        "--max-context",
    )
    parser.add_argument(
        "--search",
        type=_knobs,
        default=None,
        help=f"--max-context: settings to search, comma-separated, from: {', '.join(SEARCH_NAMES)} "
        "(default: every one that applies, tensor_parallel aside: it runs the whole search once "
        "per degree; the others stay as the recipe has them)",
    )
    parser.add_argument(
        "--resolution",
        type=_fraction,
        default=None,
        help="precision of the longest context, as a fraction of it (default: 0.03 for --longest "
        "and --sweep, one step of 1024 tokens per GPU for --max-context)",
    )
    parser.add_argument(
        "--full-trace",
        action="store_true",
        help="trace every block of the model (minutes for deep models); by default the step is "
        "traced on a shallower model that shows every distinct block and stands for the full "
        "one, to the byte (upipe_dtensor/planning/depth.py)",
    )
    parser.add_argument(
        "--longest",
        action="store_true",
        help="one plan: search the longest context at the job's own settings with plans (a few "
        "more plans; by default it is estimated from the one plan)",
    )
    parser.add_argument(
        "--expert-load",
        type=_at_least_one,
        default=1.0,
        help="one plan of a job with expert parallelism: plan the busiest rank, its experts "
        "receiving this many times their even share of the routed tokens (default 1: even "
        "routing)",
    )
    parser.add_argument("--out", default="outputs/plan", help="folder for sweep.csv and sweep.png")
    parser.add_argument(
        "--overwrite", action="store_true", help="--sweep: replace an existing sweep.csv/png"
    )
    args, overrides = parser.parse_known_args(argv)
    for arg in overrides:
        if arg.startswith("-") and "." not in arg.split("=", 1)[0]:
            parser.error(
                f"unrecognized option {arg}; the planner's options are listed above, and "
                "--section.key value overrides the job file"
            )
    if args.styles is not None and not args.sweep:
        parser.error(
            "--styles applies to --sweep seq_len; for one plan or --max-context set "
            "--parallelism.cp_style"
        )
    if args.objective == "length":
        args.max_context = True
    searching = args.max_context or args.objective == "speed"
    if args.objective == "speed" and (args.max_context or args.sweep):
        parser.error("--objective speed is a search of its own; leave out --max-context/--sweep")
    if args.expert_load != 1 and (searching or args.sweep):
        parser.error("--expert-load applies to one plan (and its --longest)")
    if args.longest and (searching or args.sweep):
        parser.error("--longest applies to one plan; --max-context and --sweep search already")
    if args.search is not None and not searching:
        parser.error("--search applies to --max-context and --objective speed")
    styles = args.styles or ["upipe", "ulysses"]
    if args.device_memory_gib is None:
        args.device_memory_gib = GPU_PROFILES[args.gpu].memory_gib
    budget = Budget(
        device_bytes=int(args.device_memory_gib * GiB),
        host_bytes_per_node=int(args.host_memory_gib * GiB),
        gpus_per_node=args.gpus_per_node,
        gpu=args.gpu,
    )
    return run_main(lambda: _answer(args, argv, overrides, styles, budget))


def _sweep(args, config: JobConfig, styles: list[str], budget: Budget) -> None:
    """The longest context per style, printed (which memory binds each) and written to --out."""
    out = Path(args.out)
    if not args.overwrite:  # before the search: it may take minutes
        refuse_existing(
            [out / name for name in SWEEP_FILES],
            "pass --overwrite to replace it, or choose another --out folder",
        )
    world_size = args.world_size or config.parallelism.world_size
    for style in styles:
        start = _with(config, seq_len=config.training.seq_len, cp_style=style)
        refuse_impossible(start, world_size, budget, (config.training.enable_cpu_offload,))
    log = (lambda _: None) if args.json else (lambda line: print(line, flush=True))
    resolution = SWEEP_RESOLUTION if args.resolution is None else args.resolution
    results = {
        style: longest_context(
            config, style, budget, args.world_size, log, resolution, args.full_trace
        )
        for style in styles
    }
    write_sweep(
        out, results, budget, sweep_title(config, world_size, budget), overwrite=args.overwrite
    )
    summary = {style: best for style, (best, _) in results.items()}
    limits = {style: limit_of(best, plans) for style, (best, plans) in results.items()}
    at_best = {style: _speed_at(best, plans) for style, (best, plans) in results.items()}
    speeds = {style: speed and speed.tokens_per_s_per_gpu for style, speed in at_best.items()}
    if args.json:
        print(
            json.dumps(
                {
                    "max_seq_len": summary,
                    "limited_by": limits,
                    "tokens_per_s_per_gpu": speeds,
                    "tokens_per_s_per_gpu_range": {
                        style: speed and list(speed.tokens_per_s_per_gpu_range)
                        for style, speed in at_best.items()
                    },
                    "budget": dataclasses.asdict(budget),
                }
            )
        )
    else:
        print(
            f"longest context that fits ({args.device_memory_gib:g} GiB/GPU, "
            f"{args.host_memory_gib:g} GiB host/node):"
        )
        for style, best in summary.items():
            binds = f", {limits[style]} binds" if limits[style] else ""
            speed = f", {at_best[style].tokens_text()}" if at_best[style] else ""
            print(f"  {style:8s} {best:>12,} tokens ({best / 2**20:.2f}M{binds}{speed})")
        print(f"wrote {out / SWEEP_FILES[0]} and {out / SWEEP_FILES[1]}")
    if not any(summary.values()):
        granule = GRANULE_TOKENS_PER_RANK * config.parallelism.context_parallel_degree
        raise DoesNotFit(
            f"{config.config_file}: no style fits even {granule:,} tokens in "
            f"{args.device_memory_gib:g} GiB per GPU and {args.host_memory_gib:g} GiB host per "
            "node"
        )


def _speed_at(seq_len: int, plans: list[Plan]) -> StepTime | None:
    """The predicted speed of the plan at ``seq_len`` (the longest that fits)."""
    for plan in plans:
        if plan.seq_len == seq_len and plan.speed is not None:
            return plan.speed
    return None


def _answer(args, argv: list[str], overrides: list[str], styles: list[str], budget: Budget) -> None:
    """One plan, a sweep or a max-context search, printed."""
    config = parse_args(["--config", args.config, *overrides])
    if args.max_context or args.objective == "speed":
        progress = (
            (lambda _: None)
            if args.json
            else (lambda line: print(line, file=sys.stderr, flush=True))
        )
        result = find_max_context(
            config,
            budget,
            args.world_size,
            search=args.search,
            resolution=args.resolution or 0.0,
            log=progress,
            objective="speed" if args.objective == "speed" else "length",
            full_trace=args.full_trace,
        )
        command = shlex.join(["python", "-m", "upipe_dtensor.plan", *argv])
        print(
            json.dumps(result.as_dict(command), indent=2)
            if args.json
            else recipe_toml(result, command).rstrip("\n")
        )
        return
    if args.sweep:
        _sweep(args, config, styles, budget)
        return
    plan = plan_job(
        config, budget, args.world_size, full_trace=args.full_trace, expert_load=args.expert_load
    )
    if not args.json:
        print(plan.render(), flush=True)
        if plan.speed:
            print(interval_line(plan.speed.step_time_s, config.checkpoint.interval), flush=True)
    untiled_line, untiled = untiled_experts_line(config, plan, args, budget)
    line, longest = longest_context_line(config, plan, args, budget)
    if args.json:
        interval = suggested_interval(plan.speed.step_time_s) if plan.speed else None
        report = {**plan.as_dict(), "checkpoint_interval": interval, "longest_context": longest}
        print(json.dumps(report | ({"untiled_moe": untiled} if untiled else {}), indent=2))
    else:
        for text in (untiled_line, line):
            if text:
                print(text)
    if not plan.fits:
        raise DoesNotFit(
            f"{config.config_file}: {plan.verdict}: {plan.device_peak_bytes / GiB:.2f} GiB per "
            f"GPU of {budget.device_bytes / GiB:g}, {plan.host_per_node_bytes / GiB:.1f} GiB host "
            f"per node of {budget.host_bytes_per_node / GiB:g}; --max-context searches the "
            "settings for the longest context that fits"
        )
