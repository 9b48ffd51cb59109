"""evaluate picks its snapshot as the trainer picks the one to resume from: verified against the
manifest, a damaged newest one set aside for an older good one, no fallback for an explicit
load_step, and the trainer's error (exit 1) when none is good."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch.distributed as dist
from harness import run_on_ranks

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 64
OTHER_ROPE = ["--model.rope_scaling_factor", "1"]
"""The debug model's RoPE is scaled by 8; a job that forgets that override sets factor 1."""


def _write_job(tmp: Path) -> Path:
    job = tmp / "job.toml"
    job.write_text(
        f'extends = "{REPO / "train_configs/debug_model.toml"}"\n'
        f'[job]\ndump_folder = "{tmp / "out"}"\n'
        f"[training]\nseq_len = {SEQ_LEN}\nlocal_batch_size = 2\nsteps = 4\n"
        f"[parallelism]\ncontext_parallel_degree = 1\n"
        f"[lr_scheduler]\nwarmup_steps = 2\n"
        f"[checkpoint]\ninterval = 2\n"
        f"[metrics]\nenable_tensorboard = false\nlog_freq = 100\n"
    )
    return job


def _evaluate(job: Path, tokens: Path, *extra: str) -> dict:
    """evaluate.main as a fresh one-process launch (its own process group, its own port)."""
    from upipe_dtensor import evaluate

    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ),
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name, None)
        code = evaluate.main(["--config", str(job), "--tokens", str(tokens), *extra])
    lines = stdout.getvalue().strip().splitlines()
    result = json.loads(lines[-1]) if code == 0 else None
    return {
        "code": code,
        "stdout": stdout.getvalue(),
        "stderr": stderr.getvalue(),
        "result": result,
    }


def _convert(snapshot: Path, target: Path, job: Path) -> dict:
    """convert --to hf of ``snapshot`` without the RoPE setting it was trained with."""
    from upipe_dtensor import convert

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = convert.main(
            ["--to", "hf", str(snapshot), str(target), "--config", str(job), *OTHER_ROPE]
        )
    return {"code": code, "stderr": stderr.getvalue(), "wrote": target.exists()}


def _damage(snapshot: Path, *, truncate: bool) -> None:
    """Flip one byte in the middle of the largest data file (same size: only the CRC can tell),
    or cut it short."""
    data = max(snapshot.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    if truncate:
        data.write_bytes(raw[: len(raw) // 2])
    else:
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(raw)


def _train_then_evaluate(rank: int, world: int, tmp: str, out: str) -> None:
    from upipe_dtensor.config import ConfigError, parse_args
    from upipe_dtensor.train.trainer import Trainer

    tmp_path = Path(tmp)
    job = _write_job(tmp_path)
    Trainer(parse_args(["--config", str(job)])).train()  # snapshots step-2 and step-4
    runs: dict = {}
    try:  # a resume without the RoPE setting it trained with (--model.rope_scaling_factor 8)
        Trainer(parse_args(["--config", str(job), "--training.steps=6", *OTHER_ROPE]))
    except ConfigError as err:
        runs["resume, other RoPE"] = str(err)
    dist.destroy_process_group()  # evaluate starts its own, as a new launch would
    checkpoints = tmp_path / "out" / "checkpoint"
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 2048, (2, SEQ_LEN)))
    runs["convert, other RoPE"] = _convert(checkpoints / "step-4", tmp_path / "hf", job)

    runs["evaluate, other RoPE"] = _evaluate(job, tokens, *OTHER_ROPE)
    runs["evaluate, other RoPE accepted"] = _evaluate(
        job, tokens, *OTHER_ROPE, "--checkpoint.accept_model_change", "true"
    )
    runs |= {
        "newest": _evaluate(job, tokens, "--overwrite"),
        "step2": _evaluate(job, tokens, "--checkpoint.load_step", "2"),
        "step2 again": _evaluate(job, tokens, "--checkpoint.load_step", "2"),
    }
    runs["outputs"] = sorted(p.name for p in (tmp_path / "out").glob("loss_by_position_*"))
    runs["record"] = json.loads(
        (tmp_path / "out" / "loss_by_position_tokens_step-4_causal.json").read_text()
    )
    _damage(checkpoints / "step-4", truncate=False)  # evaluated before: --overwrite from here on
    runs["explicit damaged"] = _evaluate(job, tokens, "--checkpoint.load_step", "4", "--overwrite")
    runs["after explicit"] = sorted(p.name for p in checkpoints.iterdir())
    runs["fallback"] = _evaluate(job, tokens, "--overwrite")
    runs["after fallback"] = sorted(p.name for p in checkpoints.iterdir())
    _damage(checkpoints / "step-2", truncate=True)
    runs["none good"] = _evaluate(job, tokens, "--overwrite")
    Path(out).write_text(json.dumps(runs))


def test_evaluate_verifies_snapshots_and_falls_back_like_the_trainer(tmp_path: Path) -> None:
    run_on_ranks(1, _train_then_evaluate, str(tmp_path), str(tmp_path / "runs.json"))
    runs = json.loads((tmp_path / "runs.json").read_text())
    checkpoints = tmp_path / "out" / "checkpoint"

    # The snapshots record the model's settings: resume, convert and evaluate compare them.
    step4, changed = checkpoints / "step-4", "rope_scaling.factor = 8.0 there, 1.0 in this job"
    assert runs["resume, other RoPE"] == (
        f"command line: snapshot {step4} was trained with other model settings: {changed}. Pass "
        "the job config (and --model.* overrides) it was trained with, or set [checkpoint] "
        "accept_model_change = true to change them on purpose (e.g. a larger rope_theta to "
        "extend the context)"
    )
    convert = runs["convert, other RoPE"]
    assert convert["code"] == 2 and not convert["wrote"], convert["stderr"]
    assert f"{step4} was trained with other model settings: {changed}." in convert["stderr"]
    refused, accepted = runs["evaluate, other RoPE"], runs["evaluate, other RoPE accepted"]
    assert (
        refused["code"] == 2
        and f"config error: command line: snapshot {step4}" in (refused["stderr"])
    )
    assert changed in refused["stderr"] and "Traceback" not in refused["stderr"]
    assert accepted["code"] == 0, accepted["stderr"]
    assert (
        f"WARNING: snapshot {step4} was trained with other model settings: {changed}; "
        in (accepted["stderr"])
    )

    newest, step2 = runs["newest"], runs["step2"]
    assert (
        newest["code"] == 0 and f"evaluated snapshot {checkpoints / 'step-4'}" in newest["stdout"]
    )
    assert step2["code"] == 0 and f"evaluated snapshot {checkpoints / 'step-2'}" in step2["stdout"]
    assert newest["result"]["loss"] != step2["result"]["loss"]  # training moved the weights
    # Each run's outputs are named by its weights and mask; nothing is written over unasked.
    assert runs["outputs"] == [
        f"loss_by_position_tokens_{step}_causal.{kind}"
        for step in ("step-2", "step-4")
        for kind in ("json", "png")
    ]
    assert runs["record"]["loss"] == newest["result"]["loss"]
    assert runs["record"]["weights"] == f"snapshot {checkpoints / 'step-4'}"
    again = runs["step2 again"]
    assert again["code"] == 2 and "loss_by_position_tokens_step-2_causal.png" in again["stderr"]
    assert "already exist; an earlier run on the same tokens, weights and mask" in again["stderr"]

    explicit = runs["explicit damaged"]  # the user named the step: no fallback, nothing renamed
    assert explicit["code"] == 1 and explicit["result"] is None
    assert (
        f"error: no good snapshot to resume from: {checkpoints / 'step-4'}: " in explicit["stderr"]
    )
    assert "is corrupt (CRC-32" in explicit["stderr"]
    assert runs["after explicit"] == ["step-2", "step-4"]

    fallback = runs["fallback"]
    assert fallback["code"] == 0, fallback["stderr"]
    assert f"WARNING: snapshot {checkpoints / 'step-4'} is damaged: " in fallback["stderr"]
    assert (
        f"WARNING: falling back to the older snapshot {checkpoints / 'step-2'}"
        in fallback["stderr"]
    )
    assert fallback["result"] == step2["result"]  # exactly step-2's weights (CPU is deterministic)
    assert runs["after fallback"] == ["step-2", "step-4.corrupt"]

    none_good = runs["none good"]
    assert none_good["code"] == 1 and none_good["result"] is None
    assert (
        f"{checkpoints / 'step-2'}: " in none_good["stderr"]
        and "the manifest says" in none_good["stderr"]
    )
    assert "move the damaged snapshots out of the checkpoint folder" in none_good["stderr"]
