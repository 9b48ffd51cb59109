"""How long the planner takes: one plan of each headline recipe traced on every block
(``plan --full-trace``) and on the reduced-depth model that stands for it (the default,
``planning/depth.py``), side by side in one process, and the ``--max-context`` search of the 8B
5M and 32B 1M stacks. Wall times of this process (imports and a first small plan done before
timing); they depend on the machine and its load, so compare the columns of one run.

    python benchmarks/planner_speed.py                  # every row (about half an hour)
    python benchmarks/planner_speed.py --no-full        # the fast plans and the searches only
    python benchmarks/planner_speed.py --recipes recipes/llama3_8b_128K.toml --no-search

Each fast plan is also checked against its full trace (the same peak, host and breakdown bytes,
the same step time), as ``tests/test_plan_depth.py`` does.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from upipe_dtensor.config import parse_args
from upipe_dtensor.planning.hardware import GPU_PROFILES
from upipe_dtensor.planning.max_context import find_max_context
from upipe_dtensor.planning.step import Budget, GiB, Plan, plan_job

REPO = Path(__file__).resolve().parents[1]
RECIPES = [
    "recipes/llama3_8b_128K.toml",
    "recipes/llama3_8b_5M.toml",
    "recipes/llama3_32b_1M.toml",
    "recipes/multinode/llama3_8b_2d_16gpu_11M.toml",
    "recipes/llama3_8b_h200_13M.toml",
]
SEARCHES = ["recipes/llama3_8b_5M.toml", "recipes/llama3_32b_1M.toml"]
logger = logging.getLogger(__name__)


def _budget(recipe: str) -> Budget:
    gpu = "h200" if "h200" in Path(recipe).name else "h100-sxm"
    return Budget(device_bytes=int(GPU_PROFILES[gpu].memory_gib * GiB), gpu=gpu)


def _timed(recipe: str, full_trace: bool) -> tuple[Plan, float]:
    config = parse_args(["--config", str(REPO / recipe)])
    started = time.perf_counter()
    plan = plan_job(config, _budget(recipe), full_trace=full_trace)
    return plan, time.perf_counter() - started


def _same(fast: Plan, full: Plan) -> bool:
    return (
        fast.device_peak_bytes == full.device_peak_bytes
        and fast.device_breakdown == full.device_breakdown
        and fast.device_peak_when == full.device_peak_when
        and fast.host_peak_bytes == full.host_peak_bytes
        and abs(fast.speed.step_time_s / full.speed.step_time_s - 1) < 1e-3
    )


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min), {os.cpu_count()} CPUs"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=RECIPES)
    parser.add_argument("--no-full", action="store_true", help="skip the full traces")
    parser.add_argument("--no-search", action="store_true", help="skip the --max-context runs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    # The one-time costs of the first plan in a process (lazy imports, kernel registries).
    plan_job(parse_args(["--config", str(REPO / "train_configs/debug_model.toml")]))
    print(f"before: {_load()}")
    print("| recipe | blocks traced | full trace | fast | speed-up | same bytes and time |")
    print("|---|---:|---:|---:|---:|---|")
    for recipe in args.recipes:
        fast, fast_s = _timed(recipe, full_trace=False)
        full_cells = ["", "", ""]
        if not args.no_full:
            full, full_s = _timed(recipe, full_trace=True)
            full_cells = [f"{full_s:.1f} s", f"{full_s / fast_s:.1f}x", str(_same(fast, full))]
        print(
            f"| `{recipe}` | {fast.traced_layers} of {fast.n_layers} | {full_cells[0]} "
            f"| {fast_s:.1f} s | {full_cells[1]} | {full_cells[2]} |",
            flush=True,
        )
    if not args.no_search:
        print("\n| --max-context of | longest context | plans | traced | wall time |")
        print("|---|---:|---:|---:|---:|")
        for recipe in SEARCHES:
            config = parse_args(["--config", str(REPO / recipe)])
            found = find_max_context(config, _budget(recipe), log=logger.info)
            print(
                f"| `{recipe}` | {found.seq_len:,} | {len(found.plans)} | {found.traces} "
                f"| {found.seconds:.0f} s |",
                flush=True,
            )
    print(f"after: {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
