"""Job files: extends, overrides, and one clear error per class of bad configuration."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from harness import run_on_ranks

from upipe_dtensor.config import ConfigError, check_job, load_config, parse_args

pytestmark = pytest.mark.unit

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
        (
            '[training]\nsteps = "ten"\n',
            r"job.toml: \[training\] steps = 'ten' should be of type int",
        ),
        (
            '[parallelism]\ncp_style = "zigzag"\n',
            r"cp_style = 'zigzag' is not one of \['upipe', 'ulysses', 'ring', 'fpdt'\]",
        ),
        ("[training\nsteps = 1\n", r"job.toml: invalid TOML"),
        ('extends = "job.toml"\n', r"'extends' cycle"),
        (
            'extends = "missing.toml"\n',
            r"job.toml: extends = 'missing.toml', but the config file .*missing.toml does not "
            r"exist",
        ),
        (
            '[training]\nseq_len = "256"\n',
            r"job.toml: \[training\] seq_len = '256' should be of type int; write it without "
            r"quotes",
        ),
        ("[training]\nseq_len = 256.0\n", r"seq_len = 256.0 should be of type int"),
    ],
)
def test_bad_files_name_file_key_and_reason(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path, "job.toml", text))


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (
            ["--training.seq_len", "63"],
            2,
            r"seq_len = 63 is not divisible by context_parallel_degree = 2",
        ),
        ([], 3, r"context_parallel_degree = 2 does not divide the 3 launched processes"),
        (
            ["--parallelism.data_parallel_shard_degree", "2"],
            2,
            r"2 x context_parallel_degree 2 = 4 != 2",
        ),
        (
            ["--parallelism.heads_per_stage", "3"],
            2,
            r"n_heads=8 is not divisible by heads_per_stage=3",
        ),
        (
            ["--parallelism.cp_style", "ulysses", "--parallelism.heads_per_stage", "4"],
            2,
            "heads_per_stage does not apply to cp_style 'ulysses'",
        ),
        (
            ["--parallelism.cp_style", "ring", "--parallelism.ring_degree", "2"],
            2,
            "cp_style 'ring': ring_degree = 2 asks for a ring axis, but this style is already a "
            "ring over all C ranks: set ring_degree = 1",
        ),
        (
            [
                "--parallelism.tensor_parallel_degree",
                "3",
                "--parallelism.context_parallel_degree",
                "1",
                "--training.seq_len",
                "48",
            ],
            3,
            r"\[parallelism\] cp_style 'upipe'.*: tensor_parallel_degree = 3 must "
            r"divide the query heads \(8\) and the KV heads \(4\).* dividing 4$",
        ),
        (
            ["--parallelism.tensor_parallel_degree", "2", "--parallelism.heads_per_stage", "8"],
            4,
            r"heads_per_stage.* \(the 4 heads of each of 2 tensor-parallel ranks\)",
        ),
        (
            ["--parallelism.tensor_parallel_degree", "2"],
            2,
            r"context_parallel_degree = 2 x tensor_parallel_degree = 2 does not divide the 2 "
            r"launched processes",
        ),
        (
            ["--parallelism.ring_degree", "3"],
            2,
            r"ring_degree = 3 must divide context_parallel_degree = 2; use one of \[1, 2\]",
        ),
        (
            ["--parallelism.cp_style", "fpdt", "--parallelism.chunk_tokens", "1"],
            2,
            "chunk_tokens 1 is smaller than the cp degree 2",
        ),
        (
            ["--parallelism.cp_style", "fpdt", "--parallelism.heads_per_stage", "2"],
            2,
            "for UPipe x FPDT use cp_style = 'upipe' with chunk_tokens",
        ),
        (
            ["--parallelism.chunk_tokens", "64", "--parallelism.ring_degree", "2"],
            2,
            r"command line: .*sequence chunks \(chunk_tokens = 64\) and a ring axis "
            r"\(ring_degree = 2\) cannot be combined",
        ),
        (
            ["--parallelism.cp_style", "ring", "--parallelism.chunk_tokens", "64"],
            2,
            r"chunk_tokens does not apply to cp_style 'ring' \(an option of cp_style 'upipe' "
            r"and 'fpdt'\); remove it",
        ),
        (
            ["--parallelism.heads_per_stage", "0"],
            2,
            r"command line: \[parallelism\] cp_style 'upipe': heads_per_stage = 0: give a "
            r"positive U .* or leave it out for U = C",
        ),
        (
            ["--parallelism.chunk_tokens", "0"],
            2,
            r"chunk_tokens = 0: give a positive number of tokens per sequence chunk, or leave "
            r"chunk_tokens out for none",
        ),
        (
            ["--parallelism.fpdt_chunk_tokens", "64"],
            2,
            r"command line: \[parallelism\] fpdt_chunk_tokens is now chunk_tokens \(the same "
            r"meaning; leave it out for none\): rename it",
        ),
        (
            ["--parallelism.context_parallel_degree", "16", "--training.seq_len", "512"],
            16,
            "n_heads=8 is not divisible by the cp degree 16",
        ),
        (
            ["--activation_checkpoint.keep_attention_skip_first", "1"],
            2,
            r"keep_attention_skip_first = 1 chooses which blocks .* keep_attention = 'none'",
        ),
        (
            [
                "--activation_checkpoint.mode",
                "full",
                "--activation_checkpoint.keep_attention",
                "host",
                "--activation_checkpoint.keep_attention_skip_first",
                "4",
            ],
            2,
            r"leaves none of the model's 4 blocks keeping its attention; use at most 3",
        ),
        (["--model.flavor", "405B"], 2, r"flavor = '405B' is unknown"),
        (["--training.dataset_path", "nowhere"], 2, r"dataset_path = 'nowhere' does not exist"),
        (["--training.steps", "0"], 2, r"\[training\] steps = 0 must be >= 1"),
        (["--unknown"], 2, "expected --section.key value"),
        (
            ["--training.dataset_split", "validation"],
            2,
            r"dataset_split choose a Hugging Face dataset's subset and split, but dataset = ",
        ),
        (["--training.dataset", " "], 2, r"command line: \[training\] dataset = ' ': use 'local'"),
        (["--training.dataset", ""], 2, r"command line: \[training\] dataset = '': use 'local'"),
        (["--checkpoint.load_step", "0"], 2, r"load_step = 0 must be -1 \(the latest snapshot\)"),
        (["--job.stop_grace_seconds", "0"], 2, r"stop_grace_seconds = 0.0 must be > 0"),
        (
            ["--compile.enable", "true", "--compile.backend", "bogus"],
            2,
            r"command line: \[compile\] backend = 'bogus' is not a torch.compile backend; use one "
            r"of \[.*'inductor'.*\] .* such as 'eager' or 'aot_eager'",
        ),
    ],
)
def test_impossible_combinations(overrides: list[str], world: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_job(
            parse_args(["--config", str(REPO / "train_configs/debug_model.toml"), *overrides]),
            world,
        )


def test_train_py_fails_fast_without_process_group(tmp_path: Path) -> None:
    """A bad file stops train.py with exit code 2 and the message, before any process group."""
    job = _write(
        tmp_path,
        "job.toml",
        "[training]\nseq_len = 63\n[parallelism]\ncontext_parallel_degree = 2\n",
    )
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--config", job],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"RANK": "0", "WORLD_SIZE": "2", "PATH": ""},
        timeout=120,
    )
    assert result.returncode == 2
    assert "seq_len = 63 is not divisible" in result.stderr


def test_config_folder_is_not_a_file(tmp_path: Path) -> None:
    _write(tmp_path, "a.toml", "")
    with pytest.raises(ConfigError, match=r"is a folder; pass a .toml job file, e.g. .*a.toml"):
        load_config(str(tmp_path))


def test_errors_blame_where_the_value_was_written(tmp_path: Path) -> None:
    """A value from the command line is the command line's fault, one from a base file the
    base's."""
    base = _write(tmp_path, "base.toml", "[training]\nseq_len = 63\n")
    job = _write(
        tmp_path, "job.toml", 'extends = "base.toml"\n[parallelism]\ncontext_parallel_degree = 2\n'
    )
    with pytest.raises(ConfigError, match=rf"^{base} and {job}: \[training\] seq_len = 63 is not"):
        check_job(load_config(job), 2)
    with pytest.raises(ConfigError, match=rf"^command line and {job}: \[training\] seq_len = 65"):
        check_job(load_config(job, ["--training.seq_len", "65"]), 2)
    with pytest.raises(ConfigError, match=r"^command line: \[training\] steps = 0"):
        check_job(load_config(job, ["--training.steps", "0", "--training.seq_len", "64"]), 2)


def _train_py():
    spec = importlib.util.spec_from_file_location("train_entry", REPO / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_py_help_no_config_and_no_torchrun(capsys, monkeypatch) -> None:
    train = _train_py()
    assert train.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--training.seq_len (int, default 2048)" in out and "each CP rank holds" in out

    assert train.main([]) == 2
    assert "--config FILE.toml is required" in capsys.readouterr().err

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    debug = str(REPO / "train_configs/debug_model.toml")
    assert train.main(["--config", debug]) == 2
    processes = parse_args(["--config", debug]).parallelism.context_parallel_degree
    assert (
        f"run torchrun --nproc_per_node {processes} train.py --config {debug}"
        in capsys.readouterr().err
    )
    assert not dist.is_initialized()


def test_tokenizer_folder_without_tokenizer_json_is_a_config_error(tmp_path: Path) -> None:
    from upipe_dtensor.train.trainer import Trainer

    config = parse_args(
        [
            "--config",
            str(REPO / "train_configs/debug_model.toml"),
            "--parallelism.context_parallel_degree",
            "1",
            "--model.tokenizer_path",
            str(tmp_path),
        ]
    )
    with pytest.raises(
        ConfigError,
        match=rf"command line: \[model\] tokenizer_path: no tokenizer.json at '{tmp_path}'",
    ):
        Trainer(config)
    assert not dist.is_initialized()  # found before any process group


def _bad_jobs_fail_before_the_model(rank: int, world: int, tmp: str) -> None:
    """Each case is a ConfigError on every rank (also one only rank 1 sees), before the model."""
    import upipe_dtensor.train.trainer as trainer_module

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built")

    trainer_module.build_parallel_model = no_model
    one_document = Path(tmp) / "one.txt"
    blank = Path(tmp) / "blank.txt"
    if rank == 0:
        one_document.write_text("the only document")
        blank.write_text(" \n\f\t\n")
    dist.barrier()
    base = [
        "--config",
        str(REPO / "train_configs/debug_model.toml"),
        "--training.seq_len",
        "64",
        "--parallelism.context_parallel_degree",
        "1",
        "--job.dump_folder",
        f"{tmp}/job",
    ]
    cases = [
        (["--training.dataset_path", str(one_document)], "dp rank 1 of 2 gets none"),
        (["--training.dataset_path", str(blank)], "has 0 non-blank documents"),
        (
            ["--checkpoint.load_step", "7"],
            r"load_step = 7, but .*job/checkpoint has no step-7; available: none",
        ),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message):
            trainer_module.Trainer(parse_args([*base, *extra]))


def test_data_and_snapshot_choice_fail_before_the_model(tmp_path: Path) -> None:
    run_on_ranks(2, _bad_jobs_fail_before_the_model, str(tmp_path))
