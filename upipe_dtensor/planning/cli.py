"""Memory planner CLI: will a recipe fit on its GPUs and in host RAM? Answered on a laptop.

    python -m upipe_dtensor.plan --config recipes/llama3_8b_5M.toml
    python -m upipe_dtensor.plan --config recipes/llama3_8b_5M.toml --sweep seq_len --styles
    upipe,ulysses

    python -m upipe_dtensor.plan --config recipes/llama3_8b_5M.toml --max-context >
    recipes/llama3_8b_max.toml

Any ``--section.key value`` overrides the recipe as in train.py. ``--sweep seq_len`` finds, for
each CP style, the longest context that fits both budgets (``length_search``) and writes
``sweep.csv`` and ``sweep.png`` to ``--out``. ``--max-context`` also searches the settings (U,
sequence chunks, FSDP CPU offload, tile sizes, block-input prefetch; ``max_context``) and prints a
recipe for the longest context with its plan. See ``upipe_dtensor.planning.step`` for what is
modelled.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from upipe_dtensor.config import CP_STYLES, JobConfig, parse_args
from upipe_dtensor.planning.length_search import GRANULE_TOKENS_PER_RANK, longest_fitting
from upipe_dtensor.planning.max_context import KNOB_NAMES, find_max_context, recipe_toml
from upipe_dtensor.planning.step import Budget, GiB, Plan, plan_job
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
        heads_per_stage=config.parallelism.heads_per_stage if same else 0,
        fpdt_chunk_tokens=config.parallelism.fpdt_chunk_tokens if same else 0,
        ring_degree=config.parallelism.ring_degree if cp_style in ("upipe", "ulysses") else 1,
    )
    training = dataclasses.replace(config.training, seq_len=seq_len)
    return dataclasses.replace(config, parallelism=parallelism, training=training)


def longest_context(
    config: JobConfig, cp_style: str, budget: Budget, world_size: int | None, log, resolution: float
) -> tuple[int, list[Plan]]:
    """The longest seq_len (a multiple of 1024 * cp, to within ``resolution`` of itself) that
    fits, and every plan evaluated (``length_search``: a few secant steps from the recipe's
    length)."""
    granule = GRANULE_TOKENS_PER_RANK * config.parallelism.context_parallel_degree

    def plan_at(seq_len: int) -> Plan:
        plan = plan_job(_with(config, seq_len=seq_len, cp_style=cp_style), budget, world_size)
        log(
            f"  {cp_style:8s} {seq_len:>12,} tokens: {plan.device_peak_bytes / GiB:7.2f} GiB "
            f"device, {plan.host_per_node_bytes / GiB:8.1f} GiB host/node -> "
            f"{'fits' if plan.fits else 'does not fit'}"
        )
        return plan

    return longest_fitting(
        plan_at, budget, start=config.training.seq_len, granule=granule, resolution=resolution
    )


def write_sweep(out: Path, results: dict[str, tuple[int, list[Plan]]], budget: Budget) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sweep.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            ["cp_style", "seq_len", "device_peak_gib", "host_per_node_gib", "fits", "max_seq_len"]
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
                        best,
                    ]
                )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for style, (best, plans) in results.items():
        points = sorted((p.seq_len, p.device_peak_bytes / GiB) for p in plans)
        axes.plot(
            [s / 2**20 for s, _ in points],
            [g for _, g in points],
            marker="o",
            label=f"{style} (max {best / 2**20:.2f}M tokens)",
        )
    axes.axhline(budget.device_bytes / GiB, color="red", linestyle="--", label="device budget")
    axes.set_xlabel("context length (M tokens)")
    axes.set_ylabel("planned peak device memory per GPU (GiB)")
    axes.set_title("Planner: peak memory vs context length")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out / "sweep.png", dpi=120)
    plt.close(figure)


def _positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a number of ``kind`` that must be > 0."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return value

    return parse


def _fraction(text: str) -> float:
    value = _positive(float)(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{text} must be between 0 and 1 (e.g. 0.03 for 3%)")
    return value


def _names(kind: str, choices: tuple[str, ...], example: str) -> Callable[[str], list[str]]:
    """A parser of comma-separated ``kind`` names, each one of ``choices``, none twice."""

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


_styles = _names("cp style", tuple(CP_STYLES), "upipe,ulysses")
_knobs = _names("setting", KNOB_NAMES, "heads_per_stage,fsdp_cpu_offload")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Any other --section.key value overrides that key of the job file, as in train.py.",
    )
    parser.add_argument("--config", required=True, help="job or recipe .toml")
    parser.add_argument(
        "--device-memory-gib", type=_positive(float), default=80.0, help="memory per GPU"
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
        help=f"cp styles to sweep, comma-separated, from: {', '.join(CP_STYLES)} "
        "(default: upipe,ulysses)",
    )
    parser.add_argument(
        "--search",
        type=_knobs,
        default=None,
        help=f"--max-context: settings to search, comma-separated, from: {', '.join(KNOB_NAMES)} "
        "(default: every one that applies; the others stay as the recipe has them)",
    )
    parser.add_argument(
        "--resolution",
        type=_fraction,
        default=None,
        help="precision of the longest context, as a fraction of it (default: 0.03 for "
        "--sweep, one step of 1024 tokens per GPU for --max-context)",
    )
    parser.add_argument("--out", default="outputs/plan", help="folder for sweep.csv and sweep.png")
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
    if args.search is not None and not args.max_context:
        parser.error("--search applies to --max-context")
    styles = args.styles or ["upipe", "ulysses"]
    budget = Budget(
        device_bytes=int(args.device_memory_gib * GiB),
        host_bytes_per_node=int(args.host_memory_gib * GiB),
        gpus_per_node=args.gpus_per_node,
    )
    return run_main(lambda: _answer(args, argv, overrides, styles, budget))


def _answer(args, argv: list[str], overrides: list[str], styles: list[str], budget: Budget) -> None:
    """One plan, a sweep or a max-context search, printed."""
    config = parse_args(["--config", args.config, *overrides])
    if args.max_context:
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
        )
        command = shlex.join(["python", "-m", "upipe_dtensor.plan", *argv])
        print(
            json.dumps(result.as_dict(command), indent=2)
            if args.json
            else recipe_toml(result, command).rstrip("\n")
        )
        return
    if args.sweep:
        log = (lambda _: None) if args.json else (lambda line: print(line, flush=True))
        resolution = 0.03 if args.resolution is None else args.resolution
        results = {
            style: longest_context(config, style, budget, args.world_size, log, resolution)
            for style in styles
        }
        write_sweep(Path(args.out), results, budget)
        summary = {style: best for style, (best, _) in results.items()}
        if args.json:
            print(json.dumps({"max_seq_len": summary, "budget": dataclasses.asdict(budget)}))
        else:
            print(
                f"longest context that fits ({args.device_memory_gib:g} GiB/GPU, "
                f"{args.host_memory_gib:g} GiB host/node):"
            )
            for style, best in summary.items():
                print(f"  {style:8s} {best:>12,} tokens ({best / 2**20:.2f}M)")
            print(f"wrote {args.out}/sweep.csv and {args.out}/sweep.png")
        return
    plan = plan_job(config, budget, args.world_size)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan.render())
