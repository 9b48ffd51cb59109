"""Ctrl-C, a killed rank and data that changes between save and resume, through train.py as a
user runs it, under torchrun on 2 ranks.

Ctrl-C is a SIGINT to the launcher's process group, as a terminal sends it: torchrun gets it (its
ranks run in sessions of their own) and passes the first press on as SIGINT, the second as
SIGTERM. The first press must still finish the step, save and say how to resume, unless the rest
of the step would outlast the grace period: then it stops at once, naming the snapshot that
stands; a second press must stop at once and leave the last good snapshot as it was. A rank killed
with SIGKILL is named by the others. A resume on data that changed since the snapshot is refused,
naming the change, unless ``[checkpoint] accept_data_change`` says to go on. Long steps are
simulated (``slow_train.py``): a step sleeps before it runs.
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


def _start(command: list[str], **env: str) -> subprocess.Popen:
    """A launch in its own session, so that a SIGINT to its group is what Ctrl-C sends."""
    return subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
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
    assert "training llama3 debugmodel" not in refused.stdout  # before the model

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


def _slow_job(dump: Path, step_seconds: float, *extra: str) -> subprocess.Popen:
    """The debug job under torchrun on 2 ranks, each step made ``step_seconds`` long
    (``slow_train.py``), a snapshot after every step."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    job = _job(dump, REPO / "assets/corpus", "--checkpoint.interval", "1", *extra)
    job[0] = str(REPO / "tests/slow_train.py")
    return _start([*command, *job], SLOW_STEP_SECONDS=str(step_seconds))


def test_ctrl_c_twice_in_the_first_step_stops_at_once_and_once_in_a_long_step_too(
    tmp_path: Path,
) -> None:
    """Under torchrun, as in a terminal. Two presses in step 1 of a new run, a step longer than
    the grace period whose length the job cannot know yet (issue 41): torchrun passes the second
    press on as SIGTERM and the ranks stop within seconds, not after the grace. Then a rerun, and
    one press while a step runs whose rest outlasts the grace period (its length is known from
    the step before): no waiting, the standing snapshot named."""
    dump = tmp_path / "job"
    job = _slow_job(dump, 40.0, "--job.stop_grace_seconds", "20")
    try:
        _wait_for(job, "training llama3 debugmodel")  # step 1 begins: 40 s long
        _press_ctrl_c(job)
        time.sleep(1.5)
        pressed = time.monotonic()
        _press_ctrl_c(job)
        out, err = job.communicate(timeout=60)
        took = time.monotonic() - pressed
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert "SIGINT received: finishing this step, then saving a snapshot" in err, err
    assert (
        "rank 0: Ctrl-C again (torchrun passes a second Ctrl-C on as SIGTERM): stopped at once, "
        "without a new snapshot (no snapshot was saved yet; step 1 will be trained again); run "
        "the same command to resume" in err
    ), err
    assert took < 10, f"the second Ctrl-C took {took:.1f} s (the step: 40 s, the grace: 20 s)"
    assert job.returncode == 1  # torchrun's own code after a signal, whatever the ranks return
    assert not list((dump / "checkpoint").glob("step-*"))

    snapshot = dump / "checkpoint" / "step-1"
    job = _slow_job(dump, 4.0, "--job.stop_grace_seconds", "1")
    try:
        _wait_for(job, "saved step-1")
        pressed = time.monotonic()
        _press_ctrl_c(job)
        out, err = job.communicate(timeout=60)
        took = time.monotonic() - pressed
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert "rank 0: SIGINT received " in err, err  # in step 2, or just before it begins
    assert (
        "more than [job] stop_grace_seconds = 1 s: stopped at once, without a new snapshot (the "
        f"last good snapshot is {snapshot}; " in err
    ), err
    assert "rank 1: SIGINT" not in err  # one line per node
    assert took < 15, f"one Ctrl-C during a long step took {took:.1f} s to stop"
    assert sorted(p.name for p in snapshot.parent.iterdir()) == ["step-1"]
    assert _intact(snapshot)


def test_a_killed_rank_is_named_with_the_snapshot_that_stands(tmp_path: Path) -> None:
    """kill -9 of one rank (what the OOM killer does): the other names it, in one line."""
    dump = tmp_path / "job"
    job = _slow_job(dump, 3.0)
    try:
        _wait_for(job, "saved step-1")
        ranks = _children(job.pid)
        lock_holder = json.loads((dump / "job.lock").read_text())["pid"]  # rank 0
        (rank_1,) = [pid for pid in ranks if pid != lock_holder]
        os.kill(rank_1, signal.SIGKILL)
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    snapshot = dump / "checkpoint" / "step-1"
    line = next((x for x in err.splitlines() if x.startswith("rank 0: rank 1 ")), "")
    assert line.startswith(f"rank 0: rank 1 (pid {rank_1}"), err
    assert " died " in line and "OOM killer" in line, line
    assert f"The last good snapshot is {snapshot}; " in line, line
    assert line.endswith("; run the same command to resume"), line
    assert "[rank0]: Traceback" not in err and "Connection reset" not in line  # no gloo trace
    assert _intact(snapshot)


def _children(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` (torchrun's ranks)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == parent:
            found.append(int(stat.parent.name))
    return found
