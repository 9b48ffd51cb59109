"""``python -m upipe_dtensor.gpu_check`` on CPU processes: the code a user's first GPU run
executes (styles against the unsharded model in bf16, one trainer step beside the planner's
prediction) runs end to end and prints its table, every style within 1.5x of the unsharded bf16
model's error. On a GPU the same command runs with every CUDA backend (tests/gpu/)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_cpu_processes() -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "-m", "upipe_dtensor.gpu_check", "--device", "cpu", "--flavor", "debugmodel",
        "--tokens-per-gpu", "128",
    ]  # fmt: skip
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    print(run.stdout)
    rows = re.findall(r"^\| (.+?) \| sdpa \| .* \| ([0-9.]+) \|$", run.stdout, re.M)
    assert {style for style, _ in rows} == {
        "UPipe (U = C)", "Ulysses", "ring", "FPDT (4 chunks)", "UPipe x FPDT (4 chunks)",
    }  # fmt: skip
    assert all(float(ratio) <= 1.5 for _, ratio in rows), rows
    assert re.search(
        r"^\| llama3 debugmodel, 256 tokens, UPipe \(U = 2\) \| [0-9,]+ \|", run.stdout, re.M
    )
