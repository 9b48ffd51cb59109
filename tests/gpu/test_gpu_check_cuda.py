"""On a CUDA machine: ``torchrun -m upipe_dtensor.gpu_check`` on every visible GPU (up to 8),
every style with every backend that works there (fa3, fa4, cudnn, flash, sdpa) within 1.5x of the
unsharded bf16 model's error and none failed, and the 8B step's measured peak within the
planner's prediction plus 10%. Skipped without CUDA."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check() -> None:
    gpus = min(torch.cuda.device_count(), 8)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus),
        "-m", "upipe_dtensor.gpu_check",
    ]  # fmt: skip
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert run.returncode == 0, run.stderr[-3000:]
    print(run.stdout)
    ratios = re.findall(
        r"^\| .+? \| (?:fa3|fa4|cudnn|flash|sdpa) \| .* \| ([0-9.]+) \|$", run.stdout, re.M
    )
    assert ratios and all(float(r) <= 1.5 for r in ratios), run.stdout
    assert "| failed: " not in run.stdout, run.stdout
    step = re.search(
        r"^\| \w+ 8B, .* \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|$", run.stdout, re.M
    )
    assert step, run.stdout
    allocated, _, planned_tracked, _ = map(float, step.groups())
    assert allocated <= 1.1 * planned_tracked, run.stdout
