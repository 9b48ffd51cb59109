"""The torchtitan plug-in's checks as a command, before torchtitan sets up a device or a process
group (``python -m upipe_dtensor.integrations.torchtitan``, ``integrations/torchtitan/tt022.py``'s
``main``): a bad option or geometry is one line, once per launch, on any machine (torchtitan
0.2.2 on a CPU machine would otherwise fail on every rank in ``torch.cuda.set_device``);
``--check-only`` runs the checks alone and says what would run; a run on a machine torchtitan
cannot train on is refused naming ``--check-only``.

In-process except the command itself, once as one process (about 6 s on 2 cores) and once under
torchrun on 2 ranks (about 6 s), whose line must reach the terminal once, whichever rank prints it.

torchtitan 0.2.2's plug-in alone has this command: on 0.3.0, ``python -m
upipe_dtensor.integrations.torchtitan`` is torchtitan's own ``main`` (``tt030.py``), a job is a
``--module``/``--config`` function rather than the job file these tests pass, and the ``[upipe]``
checks run when torchtitan's trainer builds the model (docs/torchtitan.md). Skipped there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from upipe_dtensor.integrations import torchtitan as plugin
from upipe_dtensor.models.generation import GENERATION

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        GENERATION != "tt022",
        reason="torchtitan 0.2.2's plug-in command (--check-only, its checks before device "
        "set-up, a 0.2.2 job file); 0.3.0's runs torchtitan's main",
    ),
]

REPO = Path(__file__).resolve().parents[1]
JOB = ["--job.config_file", str(REPO / "train_configs/torchtitan/llama3_8b_upipe.toml")]


@pytest.fixture
def one_process(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("options", "line"),
    [
        (["--upipe.cp_style", "bogus"], "[upipe] cp_style = 'bogus' is not one of ['upipe', "),
        (["--upipe.attention_backend", "fa9"], "[upipe] attention_backend = 'fa9' is not one of"),
        (
            ["--parallelism.context_parallel_degree", "3"],
            "[upipe] n_heads=32 is not divisible by the cp degree 3: every rank must own whole",
        ),
        (["--upipe.heads_per_stage", "12"], "[upipe] n_heads=32 is not divisible by heads_per_st"),
        (["--parallelism.tensor_parallel_degree", "2"], "[parallelism] tensor_parallel_degree = 2"),
    ],
)
def test_a_bad_option_or_geometry_is_one_line_before_any_device(
    options: list[str], line: str, capsys, one_process
) -> None:
    for mode in ([], [plugin.CHECK_ONLY]):
        assert plugin.main([*JOB, *options, *mode]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"config error: {line}") and err.count("\n") == 1, err
        assert not dist.is_initialized()


def test_check_only_says_what_would_run_and_a_machine_without_gpus_is_refused(
    capsys, one_process
) -> None:
    assert plugin.main([*JOB, plugin.CHECK_ONLY]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama3_upipe 8B: UPipeAttention(heads_per_stage=8") and out.endswith(
        "the checks passed (nothing trained: --check-only)\n"
    )
    ring = ["--upipe.cp_style", "ring", "--upipe.heads_per_stage", "None"]
    assert plugin.main([*JOB, *ring, plugin.CHECK_ONLY]) == 0
    assert "(-m torchtitan.train, cutting them by its balancer, would refuse it)" in (
        capsys.readouterr().out
    )
    if torch.cuda.is_available():
        return
    assert plugin.main(JOB) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: torchtitan 0.2.2 trains on CUDA GPUs only")
    assert "--check-only runs the plug-in's checks on any machine" in err


def test_the_command_says_a_geometry_mistake_in_one_line_on_any_machine() -> None:
    """As a user runs it, one process: torchtitan 0.2.2 on a CPU machine would fail in
    torch.cuda.set_device before the plug-in's own check is reached."""
    run = subprocess.run(
        [sys.executable, "-m", "upipe_dtensor.integrations.torchtitan", *JOB]
        + ["--parallelism.context_parallel_degree", "3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2 and run.stderr.startswith(
        "config error: [upipe] n_heads=32 is not divisible by the cp degree 3"
    ), run.stderr
    assert run.stderr.count("\n") == 1 and "_cuda_setDevice" not in run.stderr


def test_under_torchrun_the_line_is_printed_once() -> None:
    launch = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "upipe_dtensor.integrations.torchtitan",
            *JOB,
            "--parallelism.context_parallel_degree",
            "2",
            "--upipe.cp_style",
            "bogus",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    line = "config error: [upipe] cp_style = 'bogus' is not one of"
    assert launch.returncode != 0 and "(exitcode: 2)" in launch.stderr, launch.stderr
    assert launch.stderr.count(line) == 1, launch.stderr
    assert launch.stderr.count("Traceback (most recent call last)") == 1  # torchrun's own
    assert "_cuda_setDevice" not in launch.stderr
