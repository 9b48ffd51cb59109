"""Every CP style on the same job on CPU gloo ranks: measured tokens/s side by side in one run, and
the step-time model's prediction beside each (priced with this machine's measured profile).

    python benchmarks/throughput.py                      # 2 and 4 ranks, ~10 min on 2 cores
    python benchmarks/throughput.py --ranks 2 --steps 6
    python benchmarks/throughput.py --styles UPipe    # UPipe's stages overlapped and not

For each world size: ``benchmarks/cpu_profile.py`` under torchrun measures the profile, then each
style trains the debug flavor for ``--steps`` steps under torchrun (``train.py``, the job's own
``tok/s/dev`` log lines; the first step, which warms caches and compiles the compiled row's
blocks, is dropped and the median of the rest taken), and the planner traces the same job on
fake tensors (``plan_job(target="cpu")``; the compiled row from inductor's graphs, its fused
kernels counted as such: ``planning.compiled``) and prices it with the profile. Ratios are to the
first style run (UPipe, its stages overlapped) in the same run.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from upipe_dtensor.config import parse_args
from upipe_dtensor.planning.hardware import load_profile
from upipe_dtensor.planning.step import plan_job

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from timing_overrides import TIMING_RUN  # noqa: E402

DEBUG = REPO / "train_configs/debug_model.toml"
SEQ_LEN = 2048


def styles(ranks: int) -> dict[str, list[str]]:
    chunk = str(SEQ_LEN // 4)
    found = {
        "UPipe (U = C)": [],
        "UPipe (U = C), stages not overlapped": ["--parallelism.overlap_stages", "false"],
        "UPipe (U = C), compiled": ["--compile.enable", "true"],
        "Ulysses": ["--parallelism.cp_style", "ulysses"],
        "ring": ["--parallelism.cp_style", "ring"],
        "FPDT (4 chunks)": [
            "--parallelism.cp_style",
            "fpdt",
            "--parallelism.chunk_tokens",
            chunk,
        ],
        "UPipe x FPDT (4 chunks)": ["--parallelism.chunk_tokens", chunk],
    }
    if ranks >= 4:
        found["2D UPipe (2 x C/2)"] = ["--parallelism.ring_degree", "2"]
    return found


def job_args(ranks: int, extra: list[str], out: str) -> list[str]:
    return [
        "--config", str(DEBUG),
        "--training.seq_len", str(SEQ_LEN),
        "--parallelism.context_parallel_degree", str(ranks),
        *TIMING_RUN,
        "--metrics.log_freq", "1",
        "--job.dump_folder", out,
        *extra,
    ]  # fmt: skip


def torchrun(ranks: int, *args: str) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    result = subprocess.run(
        [*command, *args], cwd=REPO, capture_output=True, text=True, env=os.environ.copy()
    )
    if result.returncode:
        raise RuntimeError(f"{' '.join(args[:3])} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


def measured_tokens_per_s(output: str) -> float:
    rates = [float(m.replace(",", "")) for m in re.findall(r"tok/s/dev ([\d,]+)", output)]
    return statistics.median(rates[1:])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--styles", nargs="+", metavar="PREFIX", help="only the styles whose names start so"
    )
    args = parser.parse_args(argv)
    print("| ranks | style | measured tok/s/rank | vs UPipe | predicted | vs UPipe | error |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as scratch:
        for ranks in args.ranks:
            profile_path = Path(scratch) / f"cpu_profile_{ranks}.json"
            torchrun(ranks, "benchmarks/cpu_profile.py", "--out", str(profile_path))
            profile = load_profile(profile_path)
            rows = []
            chosen = {
                name: extra
                for name, extra in styles(ranks).items()
                if not args.styles or name.startswith(tuple(args.styles))
            }
            for name, extra in chosen.items():
                job = job_args(ranks, extra, str(Path(scratch) / "job"))
                output = torchrun(ranks, "train.py", *job, "--training.steps", str(args.steps))
                plan = plan_job(parse_args(job), world_size=ranks, target="cpu", profile=profile)
                rows.append((name, measured_tokens_per_s(output), plan.speed.tokens_per_s_per_gpu))
            base_measured, base_predicted = rows[0][1], rows[0][2]
            for name, measured, predicted in rows:
                print(
                    f"| {ranks} | {name} | {measured:,.0f} | {measured / base_measured:.2f} | "
                    f"{predicted:,.0f} | {predicted / base_predicted:.2f} | "
                    f"{predicted / measured - 1:+.0%} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
