"""The README's first command, ``torchrun --nproc_per_node 2 train.py --config
train_configs/debug_model.toml``, on 10 steps: it prints its step lines with falling losses,
and the same losses on torchtitan 0.2.2 and 0.3.0 (CI runs this file in both environments; the
numbers were measured on each, and the README's step 1 is the first of them): the model
families of the two generations build the same model from the same seed and compute the same
numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import run_command

pytestmark = pytest.mark.e2e

LOSSES = {1: 8.0622, 5: 7.4299, 10: 6.4452}
"""The step lines' losses at steps 1, 5 and 10 (log every 5 steps), on either generation."""


def test_the_readme_debug_job_trains_with_the_same_losses_on_either_generation(
    tmp_path: Path,
) -> None:
    code, stdout, stderr = run_command(
        "train.py",
        "--config",
        "train_configs/debug_model.toml",
        "--training.steps",
        "10",
        "--job.dump_folder",
        str(tmp_path / "debug_model"),
        processes=2,
    )
    assert code == 0, stderr
    losses = {
        int(line.split()[1]): float(line.split("loss ")[1].split()[0])
        for line in stdout.splitlines()
        if line.startswith("step ")
    }
    assert losses == LOSSES
    assert "training llama3 debugmodel, seq_len 512, UPipe (U = 2)" in stdout
