"""Job files: extends, overrides, and one clear error per class of bad configuration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from upipe_dtensor.config import ConfigError, check_job, load_config, parse_args

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_debug_config_is_valid() -> None:
    config = parse_args(["--config", str(REPO / "train_configs/debug_model.toml")])
    assert config.parallelism.context_parallel_degree == 2
    assert check_job(config, world_size=2) == 1


def test_extends_and_overrides(tmp_path: Path) -> None:
    _write(tmp_path, "base.toml", "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.5\n")
    job = _write(tmp_path, "job.toml", 'extends = "base.toml"\n[training]\nseq_len = 128\n')
    config = load_config(job, ["--optimizer.lr", "0.25", "--training.max_norm=2"])
    assert (config.training.steps, config.training.seq_len) == (7, 128)  # base, then file
    assert (config.optimizer.lr, config.training.max_norm) == (0.25, 2.0)  # command line wins


@pytest.mark.parametrize(
    "text,message",
    [
        ("[trainng]\nsteps = 1\n", r"job.toml: unknown section \[trainng\]"),
        ("[training]\nstepz = 1\n", r"job.toml: unknown key \[training\] stepz; known keys"),
        ('[training]\nsteps = "ten"\n', r"job.toml: \[training\] steps = 'ten' should be of type int"),
        ('[parallelism]\ncp_style = "zigzag"\n', r"cp_style = 'zigzag' is not one of \['upipe', 'ulysses', 'ring', 'fpdt'\]"),
        ("[training\nsteps = 1\n", r"job.toml: invalid TOML"),
        ('extends = "job.toml"\n', r"'extends' cycle"),
        ('extends = "missing.toml"\n', r"missing.toml does not exist"),
    ],
)
def test_bad_files_name_file_key_and_reason(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path, "job.toml", text))


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["--training.seq_len", "63"], 2, r"seq_len = 63 is not divisible by context_parallel_degree = 2"),
        ([], 3, r"context_parallel_degree = 2 does not divide the 3 launched processes"),
        (["--parallelism.data_parallel_shard_degree", "2"], 2, r"2 x context_parallel_degree 2 = 4 != 2"),
        (["--parallelism.heads_per_stage", "3"], 2, r"n_heads=8 is not divisible by heads_per_stage=3"),
        (["--parallelism.cp_style", "ulysses", "--parallelism.heads_per_stage", "4"], 2, "heads_per_stage does not apply to cp_style 'ulysses'"),
        (["--parallelism.cp_style", "ring", "--parallelism.ring_degree", "2"], 2, "'ring' is already a ring over all C ranks"),
        (["--parallelism.ring_degree", "3"], 2, r"ring_degree = 3 must divide context_parallel_degree = 2; use one of \[1, 2\]"),
        (["--parallelism.cp_style", "fpdt", "--parallelism.fpdt_chunk_tokens", "1"], 2, "chunk_tokens 1 is smaller than the cp degree 2"),
        (["--parallelism.context_parallel_degree", "16", "--training.seq_len", "512"], 16, "n_heads=8 is not divisible by the cp degree 16"),
        (["--model.flavor", "70B"], 2, r"flavor = '70B' is unknown"),
        (["--training.dataset_path", "nowhere"], 2, r"dataset_path = 'nowhere' does not exist"),
        (["--training.steps", "0"], 2, r"\[training\] steps = 0 must be >= 1"),
        (["--unknown"], 2, "expected --section.key value"),
    ],
)
def test_impossible_combinations(overrides: list[str], world: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_job(parse_args(["--config", str(REPO / "train_configs/debug_model.toml"), *overrides]), world)


def test_train_py_fails_fast_without_process_group(tmp_path: Path) -> None:
    """A bad file stops train.py with exit code 2 and the message, before any process group."""
    job = _write(tmp_path, "job.toml", "[training]\nseq_len = 63\n[parallelism]\ncontext_parallel_degree = 2\n")
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--config", job],
        capture_output=True, text=True, cwd=REPO, env={"WORLD_SIZE": "2", "PATH": ""},
        timeout=120,
    )
    assert result.returncode == 2
    assert "seq_len = 63 is not divisible" in result.stderr
