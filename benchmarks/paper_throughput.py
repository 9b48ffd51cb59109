"""The step-time model against the UPipe paper's throughput table (Table 3, tokens/s per GPU on
H100s), for every cell our recipes express. A check, never a fit: the model's constants come from
hardware and kernel sources (``planning/hardware.py``) and none of them was set from this table.
Each prediction is the central value and its band (every constant at the slow, then the fast end
of its range); the table counts the cells whose measured value falls inside the band.

Each cell is the recipe of that model, style and length with the paper's stack: FA3 kernels, each
all-to-all waited for at once (``overlap_stages = false``), attention recomputed
(``keep_attention = "none"``) and the model states on the GPU
(``[training] enable_cpu_offload = false``); for 32B on 16 GPUs the paper's layout for Ulysses and
UPipe, 8-way heads inside a node times a ring of 2 across the nodes (``ring_degree = 2``; U = 8).
The rest (block inputs offloaded to the host, tiled MLP, chunked loss, FPDT's chunks) is the
recipe's, as in the paper's runs, except how the block inputs reach the host: the paper's code
copies them with ``save_on_cpu`` on the compute stream, each copy waited for, and the cells are
priced so (``StepShape.offload_on_compute_stream``) where this repository's recipes copy them on
side streams. Native PyTorch CP is not a style here.

    python benchmarks/paper_throughput.py --out benchmarks/results/paper_throughput.json
    python benchmarks/paper_throughput.py --table benchmarks/results/paper_throughput.json
    python benchmarks/paper_throughput.py --levers benchmarks/results/paper_throughput.json

Cells already in ``--out`` are kept (a run resumes where it stopped; all 37 take a few hours on 2
CPU cores). The results keep each cell's counted work, so ``--table`` prices them with the
current model without tracing again, and prints the markdown table of cells, errors and the
ratios UPipe/Ulysses, FPDT/UPipe and ring/Ulysses (docs/measurements.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from upipe_dtensor.config import parse_args
from upipe_dtensor.models import FLAVORS
from upipe_dtensor.planning.hardware import H100_SXM, HardwareProfile
from upipe_dtensor.planning.step import plan_job
from upipe_dtensor.planning.step_time import StepShape, StepTime, predict_step_time, speedup
from upipe_dtensor.planning.step_work import StepWork

REPO = Path(__file__).resolve().parents[1]
LENGTHS = ("128K", "256K", "512K", "1M", "2M", "3M", "4M", "5M")
PAPER = {
    # (model, style): tokens/s per GPU by length, the paper's Table 3 (None: OOM or not run)
    ("8B", "ring"): (2064.90, 1387.67, 841.05, 458.51, 237.99, 159.96, None, None),
    ("8B", "ulysses"): (2320.47, 1503.80, 878.63, 475.33, 246.05, 162.41, None, None),
    ("8B", "fpdt"): (1171.68, 884.75, 621.20, 382.42, 219.53, 153.48, 119.76, None),
    ("8B", "upipe"): (2281.05, 1487.29, 867.17, 472.53, 246.07, 166.32, 125.56, 98.25),
    ("32B", "ring"): (418.39, 308.88, 194.44, 110.27, 58.45, None, None, None),
    ("32B", "ulysses"): (545.29, 370.70, 217.04, 117.02, 59.98, None, None, None),
    ("32B", "fpdt"): (286.40, 217.85, 151.91, 95.88, 55.41, 38.86, 27.66, None),
    ("32B", "upipe"): (483.29, 339.56, 204.46, 113.26, 59.56, 40.42, 29.97, None),
}
PAPER_STACK = [  # the paper's code runs eager
    "--parallelism.attention_backend",
    "fa3",
    "--compile.enable",
    "false",
    "--activation_checkpoint.keep_attention",
    "none",
    "--activation_checkpoint.keep_attention_skip_first",
    "0",
    "--training.enable_cpu_offload",
    "false",
]
STYLE_STACK = {  # the paper's UPipe waits for each all-to-all (no overlapped stages)
    "upipe": ["--parallelism.overlap_stages", "false"],
}
TWO_D = {  # the paper's 32B layout for the head-parallel styles: 8 heads-way x a ring of 2
    "upipe": ["--parallelism.ring_degree", "2", "--parallelism.heads_per_stage", "8"],
    "ulysses": ["--parallelism.ring_degree", "2"],
}


def recipe(model: str, style: str, length: str) -> Path | None:
    """The recipe file of a cell, or None when none expresses it."""
    name = f"llama3_{model.lower()}{'' if style == 'upipe' else '_' + style}_{length}.toml"
    path = REPO / "recipes" / ("" if style == "upipe" else "baselines") / name
    return path if path.exists() else None


def cells() -> list[tuple[str, str, str, float, Path]]:
    """Every expressible cell, shortest contexts first (a partial run covers every style)."""
    found = []
    for (model, style), row in PAPER.items():
        for length, paper in zip(LENGTHS, row):
            path = recipe(model, style, length)
            if paper is not None and path is not None:
                found.append((model, style, length, paper, path))
    return sorted(found, key=lambda cell: (LENGTHS.index(cell[2]), cell[0], cell[1]))


def predict(model: str, style: str, path: Path) -> dict:
    overrides = PAPER_STACK + STYLE_STACK.get(style, [])
    overrides += TWO_D.get(style, []) if model == "32B" else []
    config = parse_args(["--config", str(path), *overrides])
    started = time.perf_counter()
    plan = plan_job(config)
    return {
        "recipe": str(path.relative_to(REPO)),
        "overrides": overrides,
        "work": plan.speed.counted.to_json(),
        "shape": dataclasses.asdict(plan.speed.shape),
        "device_peak_gib": plan.device_peak_bytes / 2**30,
        "planned_in_s": time.perf_counter() - started,
    }


def priced(cell: dict, profile: HardwareProfile, **changes) -> StepTime:
    """A saved cell's counted work priced with ``profile`` (the current model, no new trace) as
    the paper's code runs it: block inputs copied on the compute stream (``changes`` apply on
    top, e.g. this repository's side-stream offload)."""
    shape = replace(StepShape(**cell["shape"]), **{"offload_on_compute_stream": True, **changes})
    return predict_step_time(StepWork.from_json(cell["work"]), shape, profile)


def run(out: Path) -> None:
    results = json.loads(out.read_text()) if out.exists() else {}
    for model, style, length, paper, path in cells():
        key = f"{model} {style} {length}"
        if key in results:
            continue
        result = predict(model, style, path)
        results[key] = {"paper": paper, **result}
        out.parent.mkdir(parents=True, exist_ok=True)
        temporary = out.with_suffix(".tmp")
        temporary.write_text(json.dumps(results, indent=1))
        temporary.replace(out)
        speed = priced(results[key], H100_SXM).tokens_per_s_per_gpu
        print(f"{key}: predicted {speed:.1f} vs {paper} ({speed / paper - 1:+.1%})", flush=True)


def table(results: dict, profile: HardwareProfile = H100_SXM) -> str:
    speeds = {key: priced(cell, profile) for key, cell in results.items()}
    lines = [
        "| model | style | length | paper tokens/s/GPU | predicted (central) | band | error "
        "| in band |",
        "|---|---|---:|---:|---:|---:|---:|:---:|",
    ]
    errors, inside = [], 0
    for key, cell in results.items():
        model, style, length = key.split()
        speed = speeds[key]
        low, high = speed.tokens_per_s_per_gpu_range
        error = speed.tokens_per_s_per_gpu / cell["paper"] - 1
        errors.append(abs(error))
        within = low <= cell["paper"] <= high
        inside += within
        lines.append(
            f"| {model} | {style} | {length} | {cell['paper']:.2f} | "
            f"{speed.tokens_per_s_per_gpu:.2f} | {low:.2f}-{high:.2f} | {error:+.1%} | "
            f"{'yes' if within else 'no'} |"
        )
    if errors:
        lines.append(
            f"\n{len(errors)} cells; inside the band: {inside} of {len(errors)}; central value: "
            f"mean |error| {sum(errors) / len(errors):.1%}, largest {max(errors):.1%}; within "
            f"15%: {sum(e <= 0.15 for e in errors)}."
        )
    lines += [
        "",
        "| model | ratio | length | paper | predicted (central) | band | difference |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for model in ("8B", "32B"):
        for top, bottom in (("upipe", "ulysses"), ("fpdt", "upipe"), ("ring", "ulysses")):
            for length in LENGTHS:
                keys = [f"{model} {style} {length}" for style in (top, bottom)]
                if all(key in results for key in keys):
                    paper = results[keys[0]]["paper"] / results[keys[1]]["paper"]
                    ours, low, high = speedup(speeds[keys[0]], speeds[keys[1]])
                    lines.append(
                        f"| {model} | {top}/{bottom} | {length} | {paper:.3f} | {ours:.3f} | "
                        f"{low:.3f}-{high:.3f} | {ours - paper:+.3f} |"
                    )
    return "\n".join(lines)


def _stages(cell: dict) -> int:
    """H / U of a UPipe cell's recipe (with its overrides): the stages that can overlap."""
    config = parse_args(["--config", str(REPO / cell["recipe"]), *cell["overrides"]])
    n_heads = FLAVORS[config.model.flavor].n_heads
    return n_heads // config.parallelism.stage_heads(n_heads)


def band(speed: StepTime) -> str:
    """Tokens/s per GPU, central (low-high)."""
    low, high = speed.tokens_per_s_per_gpu_range
    return f"{speed.tokens_per_s_per_gpu:.1f} ({low:.1f}-{high:.1f})"


def ratio(top: StepTime, bottom: StepTime) -> str:
    """top / bottom in tokens/s, central (low-high) (``step_time.speedup``)."""
    central, low, high = speedup(top, bottom)
    return f"{central:.3f}x ({low:.3f}-{high:.3f})"


def levers(results: dict, profile: HardwareProfile = H100_SXM) -> str:
    """What each lever buys UPipe, priced from the same counted work (predictions, central and
    band): the kernel (FlashAttention-2 -> FA3, the paper's stack), this repository's offload
    (side streams, prefetched, instead of the paper's copies on the compute stream) and
    overlapped stages; the ratio is against the model's own price of the paper's stack, and
    Ulysses is priced on the same stack as the last column."""
    lines = [
        f"Predicted tokens/s per GPU ({profile.name} profile), not GPU measurements: central "
        "value (band).\n",
        "| model | length | paper UPipe, measured | FA2 | FA3, the paper's stack | + side-stream "
        "offload | + overlapped stages | vs the paper's stack (model) | vs Ulysses (same stack) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ours = {"offload_on_compute_stream": False}
    for key, cell in results.items():
        model, style, length = key.split()
        if style != "upipe":
            continue
        speeds = [
            priced(cell, profile, **changes)
            for changes in (
                {"backend": "flash"},
                {},
                ours,
                {**ours, "overlapped_stages": _stages(cell)},
            )
        ]
        ulysses = results.get(f"{model} ulysses {length}")
        versus = ratio(speeds[-1], priced(ulysses, profile, **ours)) if ulysses else "-"
        lines.append(
            f"| {model} | {length} | {cell['paper']:.2f} | "
            + " | ".join(band(speed) for speed in speeds)
            + f" | {ratio(speeds[-1], speeds[1])} | {versus} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="run the cells, results (JSON) here")
    parser.add_argument("--table", type=Path, help="print the markdown table of a results file")
    parser.add_argument(
        "--levers", type=Path, help="print what the kernel and overlapped stages buy UPipe"
    )
    args = parser.parse_args(argv)
    if args.out:
        run(args.out)
    if args.table or args.out:
        print(table(json.loads((args.table or args.out).read_text())))
    if args.levers:
        print(levers(json.loads(args.levers.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
