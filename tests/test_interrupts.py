"""Ctrl-C and data that changes between save and resume, through train.py as a user runs it.

Ctrl-C is a SIGINT to the whole process group, as a terminal sends it: torchrun and every rank
get it, and torchrun forwards it to the ranks once more. The first press must still finish the
step, save and say how to resume; a second one must stop at once and leave the last good snapshot
as it was. A resume on data that changed since the snapshot is refused, naming the change,
unless ``[checkpoint] accept_data_change`` says to go on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
STEPS = 30


def _job(dump: Path, corpus: Path, *extra: str) -> list[str]:
    return [
        str(REPO / "train.py"),
        "--config",
        str(REPO / "train_configs/debug_model.toml"),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        str(STEPS),
        "--training.dataset_path",
        str(corpus),
        "--training.skip_bad_records",
        "true",
        "--lr_scheduler.warmup_steps",
        "1",
        "--checkpoint.interval",
        "1000",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "false",
        "--job.dump_folder",
        str(dump),
        *extra,
    ]


def _start(command: list[str]) -> subprocess.Popen:
    """A launch in its own session, so that a SIGINT to its group is what Ctrl-C sends."""
    return subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _press_ctrl_c(job: subprocess.Popen) -> None:
    os.killpg(job.pid, signal.SIGINT)


def _wait_for(job: subprocess.Popen, prefix: str) -> list[str]:
    """stdout lines up to the first one starting with ``prefix``."""
    lines = []
    for line in job.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"no line starting with {prefix!r}: {''.join(lines)}")


def _intact(snapshot: Path) -> bool:
    manifest = json.loads((snapshot / "manifest.json").read_text())
    return all(
        (len(data := (snapshot / name).read_bytes()), zlib.crc32(data))
        == (entry["bytes"], entry["crc32"])
        for name, entry in manifest["files"].items()
    )


def _trained_steps(output: str) -> list[int]:
    return [int(line.split()[1]) for line in output.splitlines() if line.startswith("step ")]


def test_ctrl_c_saves_and_a_resume_on_changed_data_is_refused(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    documents = [
        json.dumps({"text": f"document {i} " + "tells a story " * (5 + i % 9)}) for i in range(60)
    ]
    documents.insert(45, "{not json")  # a bad record, skipped: counted in the log
    (corpus / "docs.jsonl").write_text("\n".join(documents) + "\n")
    dump = tmp_path / "job"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    job = _start([*command, "--nproc_per_node=2", *_job(dump, corpus)])
    try:
        _wait_for(job, "step ")
        _press_ctrl_c(job)  # reaches each rank twice: from the "terminal" and from torchrun
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert f"WARNING: skipping 1 bad record of 61 in dataset_path '{corpus}'" in err
    assert "SIGINT received: finishing this step, then saving a snapshot and stopping" in err
    stopped = [line for line in err.splitlines() if line.startswith("stopped by SIGINT")]
    assert stopped, err
    step = int(stopped[0].split()[5])
    snapshot = dump / "checkpoint" / f"step-{step}"
    assert stopped[0] == (
        f"stopped by SIGINT after step {step} of {STEPS} (the last good snapshot is {snapshot}); "
        "run the same command to resume"
    )
    assert f"saved step-{step} to {snapshot}" in out and _intact(snapshot)
    assert "KeyboardInterrupt" not in err and "stopped at once" not in err  # one press

    # Ten documents removed, some of them already read: the position now points elsewhere.
    (corpus / "docs.jsonl").write_text("\n".join(documents[10:]) + "\n")
    one_process = [sys.executable, *_job(dump, corpus, "--parallelism.context_parallel_degree=1")]
    refused = subprocess.run(one_process, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr
    assert (
        f"config error: the training data changed since snapshot {snapshot} was saved: 1 file "
        "changed (docs.jsonl); the " in refused.stderr
    )
    assert "documents read before the snapshot differ" in refused.stderr
    assert "set [checkpoint] accept_data_change = true" in refused.stderr
    assert "training debugmodel" not in refused.stdout  # before the model

    accepted = subprocess.run(
        [*one_process, "--checkpoint.accept_data_change", "true"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert accepted.returncode == 0, accepted.stderr
    assert f"WARNING: the training data changed since snapshot {snapshot}" in accepted.stderr
    assert _trained_steps(accepted.stdout) == list(range(step + 1, STEPS + 1))


def test_a_second_ctrl_c_stops_at_once_and_keeps_the_last_snapshot(tmp_path: Path) -> None:
    """One process, long steps (4096 tokens): the second press comes while step 2 runs."""
    dump = tmp_path / "job"
    job = _start(
        [
            sys.executable,
            *_job(
                dump,
                REPO / "assets/corpus",
                "--parallelism.context_parallel_degree",
                "1",
                "--training.seq_len",
                "4096",
                "--training.local_batch_size",
                "1",
                "--checkpoint.interval",
                "1",
            ),
        ]
    )
    try:
        _wait_for(job, "saved step-1")
        _press_ctrl_c(job)
        time.sleep(1.5)  # longer than one press lasts (SAME_PRESS_SECONDS)
        pressed = time.monotonic()
        _press_ctrl_c(job)
        out, err = job.communicate(timeout=60)
        took = time.monotonic() - pressed
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    snapshot = dump / "checkpoint" / "step-1"
    assert job.returncode == 128 + signal.SIGINT, err
    assert (
        f"rank 0: Ctrl-C again: stopped at once, without a new snapshot (the last good snapshot "
        f"is {snapshot}); run the same command to resume" in err
    )
    assert _trained_steps(out) == [], out  # step 2 never finished
    assert sorted(p.name for p in snapshot.parent.iterdir()) == ["step-1"]
    assert _intact(snapshot)
    assert took < 10, f"the second Ctrl-C took {took:.1f} s"
