"""The predicted speed of each recipe as the README's recipe table and the recipes' header comments
state it: tokens/s per GPU, central value and band (every constant at the slow, then the fast end
of its range, ``planning/hardware.py``), with the peak per GPU and host per node, and the ratio to
the model's own price of the paper's UPipe stack at the same length where the paper has that cell
(the stored counted work of ``benchmarks/paper_throughput.py``, priced as the paper's code runs:
block inputs copied on the compute stream). Predictions, not GPU measurements.

    python benchmarks/recipe_speeds.py                       # every recipe below (minutes)
    python benchmarks/recipe_speeds.py --recipes recipes/llama3_8b_128K.toml

A recipe whose name says h200 is planned on the h200 profile with 140 GiB per GPU, every other on
h100-sxm with 80 GiB; 2 TiB of host per node, 8 GPUs per node (``plan``'s defaults). Each plan
traces a reduced-depth model that stands for the recipe's (``planning/depth.py``, the same bytes
and times as ``plan --full-trace``); ``--full-trace`` traces every block (hours). The paper's
cells exist for the Llama3 shapes only (Qwen3 rows have no ratio).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from upipe_dtensor.config import parse_args
from upipe_dtensor.planning.hardware import GPU_PROFILES
from upipe_dtensor.planning.step import Budget, GiB, plan_job

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from paper_throughput import LENGTHS, band, priced, ratio  # noqa: E402

RECIPES = [
    "recipes/llama3_8b_128K.toml",
    "recipes/llama3_8b_256K.toml",
    "recipes/llama3_8b_512K.toml",
    "recipes/llama3_8b_1M.toml",
    "recipes/llama3_8b_2M.toml",
    "recipes/llama3_8b_3M.toml",
    "recipes/llama3_8b_4M.toml",
    "recipes/llama3_8b_5M.toml",
    "recipes/llama3_8b_8M.toml",
    "recipes/llama3_32b_1M.toml",
    "recipes/llama3_32b_2M.toml",
    "recipes/llama3_32b_4M.toml",
    "recipes/llama3_32b_6M.toml",
    "recipes/multinode/llama3_8b_2d_16gpu_11M.toml",
    "recipes/multinode/llama3_8b_2d_32gpu_20M.toml",
    "recipes/multinode/llama3_32b_2d_16gpu_8M.toml",
    "recipes/multinode/llama3_32b_2d_32gpu_16M.toml",
    "recipes/llama3_8b_h200_13M.toml",
    "recipes/llama3_32b_h200_12M.toml",
    "recipes/qwen3_8b_1M.toml",
    "recipes/qwen3_8b_4M.toml",
    "recipes/qwen3_32b_1M.toml",
    "recipes/qwen3_32b_4M.toml",
]
STORED = REPO / "benchmarks/results/paper_throughput.json"
logger = logging.getLogger(__name__)


def length_name(seq_len: int) -> str:
    """128K, 1M, ... as the paper's table names lengths ("" for one it does not have)."""
    name = f"{seq_len // 2**20}M" if seq_len % 2**20 == 0 else f"{seq_len // 2**10}K"
    return name if name in LENGTHS else ""


def row(recipe: str, stored: dict, full_trace: bool = False) -> str:
    h200 = "h200" in Path(recipe).name
    gpu = "h200" if h200 else "h100-sxm"
    budget = Budget(device_bytes=int(GPU_PROFILES[gpu].memory_gib * GiB), gpu=gpu)
    config = parse_args(["--config", str(REPO / recipe)])
    started = time.perf_counter()
    plan = plan_job(config, budget, full_trace=full_trace)
    logger.info(
        "%s: planned in %.1f s (%d of %d blocks traced)",
        recipe,
        time.perf_counter() - started,
        plan.traced_layers,
        plan.n_layers,
    )
    model = "32B" if "32b" in Path(recipe).name else "8B"
    cell = None  # the paper ran Llama3 shapes only
    if config.model.name == "llama3":
        cell = stored.get(f"{model} upipe {length_name(plan.seq_len)}")
    versus = ratio(plan.speed, priced(cell, GPU_PROFILES[gpu])) if cell else ""
    return (
        f"| `{recipe}` | {plan.world_size} | {plan.seq_len:,} | {band(plan.speed)} "
        f"| {versus} | {plan.device_peak_bytes / GiB:.2f} GiB | "
        f"{plan.host_per_node_bytes / GiB:,.0f} GiB | {gpu} |"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=RECIPES)
    parser.add_argument(
        "--full-trace", action="store_true", help="trace every block of every recipe (hours)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    stored = json.loads(STORED.read_text())
    print(
        "| recipe | GPUs | tokens | predicted tokens/s per GPU, central (band) | vs the paper's "
        "UPipe stack (model) | peak per GPU | host per node | profile |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for recipe in args.recipes:
        print(row(recipe, stored, args.full_trace), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
