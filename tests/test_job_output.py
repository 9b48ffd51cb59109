"""What a job shows and records: the rank-aware log format and its switches (``runtime.logs``),
the step line and the metrics sinks (``runtime.metrics``), Weights & Biases through a fake module
(no network, no wandb needed) and its one-line refusal when it is not installed.

The real runs' output (the Quick start's lines on rank 0 under torchrun, tensorboard and JSONL
losses after a resume) is checked by test_faults.py and test_interrupts.py.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from upipe_dtensor.config import ConfigError, parse_args
from upipe_dtensor.runtime.logs import ConsoleHandler, set_up_logging
from upipe_dtensor.runtime.metrics import (
    JsonlSink,
    MetricsLogger,
    WandbSink,
    step_line,
)
from upipe_dtensor.train.trainer import open_sinks

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "train_configs/debug_model.toml")
LOG = logging.getLogger("upipe_dtensor.train.trainer")  # any module of the package


@pytest.fixture
def package_logger():
    """The package logger as it was: each test's set-up is undone."""
    package = logging.getLogger("upipe_dtensor")
    level, handlers = package.level, list(package.handlers)
    yield
    for handler in [h for h in package.handlers if h not in handlers]:
        package.removeHandler(handler)
    package.setLevel(level)


def _logged(capsys, monkeypatch, rank: int, **env: str) -> tuple[str, str]:
    """(stdout, stderr) of one INFO and one WARNING line after set-up as ``rank``."""
    for name in ("UPIPE_LOG_LEVEL", "UPIPE_LOG_RANKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    set_up_logging(rank)
    capsys.readouterr()
    LOG.info("step     1 | loss 8.0622")
    LOG.warning("careful")
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_rank_0_logs_plain_lines_and_other_ranks_only_warnings(
    capsys, monkeypatch, package_logger
) -> None:
    assert _logged(capsys, monkeypatch, 0) == ("step     1 | loss 8.0622\n", "WARNING: careful\n")
    assert _logged(capsys, monkeypatch, 3) == ("", "[rank 3] WARNING: careful\n")
    everyone = _logged(capsys, monkeypatch, 3, UPIPE_LOG_RANKS="all")
    assert everyone == ("[rank 3] step     1 | loss 8.0622\n", "[rank 3] WARNING: careful\n")
    assert _logged(capsys, monkeypatch, 8, UPIPE_LOG_RANKS="0,8")[0] == (
        "[rank 8] step     1 | loss 8.0622\n"
    )
    assert _logged(capsys, monkeypatch, 0, UPIPE_LOG_LEVEL="warning") == ("", "WARNING: careful\n")
    set_up_logging(0)  # again: one handler, so one copy of each line
    handlers = logging.getLogger("upipe_dtensor").handlers
    assert sum(isinstance(h, ConsoleHandler) for h in handlers) == 1
    with pytest.raises(ConfigError, match="UPIPE_LOG_LEVEL='loud' is not a log level"):
        _logged(capsys, monkeypatch, 0, UPIPE_LOG_LEVEL="loud")
    with pytest.raises(ConfigError, match="UPIPE_LOG_RANKS='first'"):
        _logged(capsys, monkeypatch, 0, UPIPE_LOG_RANKS="first")


class _FakeRun:
    def __init__(self, **init) -> None:
        self.init, self.logged, self.finished = init, [], False

    def log(self, scalars: dict, step: int) -> None:
        self.logged.append((step, scalars))

    def finish(self) -> None:
        self.finished = True


def test_every_sink_gets_every_scalar_and_the_step_line_its_fields(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    runs: list[_FakeRun] = []
    fake_wandb = SimpleNamespace(init=lambda **init: runs.append(_FakeRun(**init)) or runs[-1])
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    monkeypatch.setenv("WANDB_PROJECT", "long-context")
    metrics = SimpleNamespace(
        enable_tensorboard=False,
        save_tb_folder="tb",
        enable_jsonl=True,
        save_jsonl_file="logs/metrics.jsonl",
        enable_wandb=True,
    )
    sinks = open_sinks(metrics, tmp_path, first_step=1, run_config={"training": {"steps": 2}})
    assert [type(sink) for sink in sinks] == [JsonlSink, WandbSink]
    logger = MetricsLogger(
        sinks=sinks, log_freq=10, device=torch.device("cpu"), flops_per_token=1e9, world_size=2
    )
    caplog.set_level(logging.INFO, logger="upipe_dtensor")
    for step in (1, 2):
        logger.log(
            step,
            {"loss": 8.0 - step, "grad_norm": 1.5, "lr": 3e-4, "attention_share": 0.25},
            tokens=4096,
            seconds=2.0,
        )
    logger.close()

    rows = [
        json.loads(line) for line in (tmp_path / "logs/metrics.jsonl").read_text().split("\n")[:-1]
    ]
    assert [(row["step"], row["loss"]) for row in rows] == [(1, 7.0), (2, 6.0)]
    assert rows[0]["tokens_per_second_per_device"] == 1024.0  # 4096 tokens / 2 s / 2 ranks
    assert {"memory_peak_gib", "attention_share"} <= rows[0].keys()
    assert "mfu_percent" not in rows[0]  # no peak for a CPU: no made-up MFU
    (run,) = runs
    assert run.init == {
        "project": "long-context",
        "dir": str(tmp_path),
        "config": {"training": {"steps": 2}},
    }
    assert [(step, scalars["loss"]) for step, scalars in run.logged] == [(1, 7.0), (2, 6.0)]
    assert run.logged[0][1] == {k: v for k, v in rows[0].items() if k != "step"}
    assert run.finished
    # Logged on step 1 and every log_freq steps; the extra scalar at the end of the line.
    (line,) = [r.getMessage() for r in caplog.records if r.name == "upipe_dtensor.runtime.metrics"]
    assert line.startswith(
        "step     1 | loss 7.0000 | grad_norm 1.500 | lr 3.00e-04 | tok/s/dev 1,024 | mfu n/a | "
        "mem "
    )
    assert line.endswith(" GiB | attention_share 0.25")

    # A resumed run (from step 2) drops the lines of the steps it replays.
    JsonlSink(tmp_path / "logs/metrics.jsonl", first_step=2).close()
    kept = (tmp_path / "logs/metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in kept] == [1]


def test_step_line_of_a_gpu_step_keeps_its_field_order() -> None:
    scalars = {
        "loss": 8.0622,
        "grad_norm": 0.914,
        "lr": 6e-4,
        "host_offload_gib": 3.0,
        "tokens_per_second_per_device": 1234.5,
        "mfu_percent": 41.25,
        "memory_peak_gib": 70.5,
        "memory_reserved_gib": 75.25,
    }
    assert step_line(7, scalars) == (
        "step     7 | loss 8.0622 | grad_norm 0.914 | lr 6.00e-04 | tok/s/dev 1,234 | "
        "mfu 41.2% | mem 70.50 GiB (reserved 75.25 GiB) | host offload 3.00 GiB"
    )


def test_wandb_asked_for_but_missing_is_one_config_error(tmp_path, capsys, monkeypatch) -> None:
    """Before any process group or data read, through train.py as a user runs it."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails, as when not installed
    spec = importlib.util.spec_from_file_location("train_entry", REPO / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    argv = ["--config", DEBUG, "--parallelism.context_parallel_degree", "1"]
    dump = ["--job.dump_folder", str(tmp_path / "job")]
    assert train.main([*argv, *dump, "--metrics.enable_wandb", "true"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "config error: command line: [metrics] enable_wandb = true, but wandb is not installed "
        "here: pip install wandb, or set enable_wandb = false"
    ]
    assert not (tmp_path / "job").exists()  # refused before the dump folder was claimed
    assert parse_args(argv).metrics.enable_wandb is False  # never on unless asked for
