"""Atomic, verified torch.distributed.checkpoint snapshots: model, optimizer, LR schedule, data
loader, step.

A snapshot is written to ``step-N.partial``; when every rank has finished, the size and CRC-32 of
each file go into its ``manifest.json`` and only then is it renamed to ``step-N``. A job killed
mid-save therefore never leaves a snapshot that looks complete, and a snapshot damaged later (a
bad disk block, a truncated copy) is caught before loading: the job reports it, sets it aside as
``step-N.corrupt`` and falls back to the newest good one. Model and optimizer state are DTensors,
so a snapshot taken with one cp degree loads into a job with another; the data loader's position
is per data-parallel rank, so the data-parallel degree must stay the same.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from upipe_dtensor.checkpointing.manifest import read_manifest, verify, write_manifest
from upipe_dtensor.checkpointing.storage import human, is_out_of_space, no_space_error
from upipe_dtensor.config.schema import JobConfig
from upipe_dtensor.errors import ConfigError, JobComplete, JobError
from upipe_dtensor.runtime.collectives import on_rank0

logger = logging.getLogger(__name__)

_SNAPSHOT = re.compile(r"^step-(\d+)$")


def snapshots(folder: Path) -> dict[int, Path]:
    """Published snapshots by step (``.partial`` and ``.corrupt`` folders are not listed)."""
    if not folder.is_dir():
        return {}
    found = (_SNAPSHOT.match(p.name) for p in folder.iterdir() if p.is_dir())
    return {int(m.group(1)): folder / m.group(0) for m in found if m}


def snapshot_candidates(config: JobConfig, folder: Path) -> list[int]:
    """Steps of the snapshots to try, newest first (only ``load_step`` if one is given), from
    folder names alone; a missing ``load_step`` is a ``ConfigError``. Not collective."""
    found = sorted(snapshots(folder), reverse=True)
    load_step = config.checkpoint.load_step
    if load_step == -1:
        return found
    if load_step not in found:
        raise ConfigError(
            f"{config.source_of('checkpoint.load_step')}: [checkpoint] load_step = {load_step}, "
            f"but {folder} has no step-{load_step}; available: {sorted(found) or 'none'} "
            "(-1 picks the latest)"
        )
    return [load_step]


def resume_candidates(config: JobConfig, folder: Path) -> list[int]:
    """``snapshot_candidates`` for a training job, which must still have steps to train.

    Decided from folder names alone, before any heavy work: a finished job raises
    ``JobComplete``; a snapshot beyond ``[training] steps`` is a ``ConfigError``.
    """
    found, steps = snapshot_candidates(config, folder), config.training.steps
    if found and found[0] == steps:
        raise JobComplete(
            f"job already complete: snapshot step-{steps} in {folder} reached [training] steps = "
            f"{steps}; nothing to train (raise --training.steps to train further)"
        )
    if found and found[0] > steps:
        raise ConfigError(
            f"{config.source_of('training.steps')}: [training] steps = {steps}, but {folder} "
            f"already holds snapshot step-{found[0]}; set --training.steps above {found[0]} to "
            "train further, or use another [job] dump_folder to start a new run"
        )
    return found


def choose_snapshot(
    folder: Path, candidates: list[int], *, explicit: bool, job: dict[str, Any] | None
) -> Path | None:
    """The newest candidate that passes verification (collective; before the model is built).

    Bad ones are reported by name; when an older good one exists they are renamed
    ``step-N.corrupt`` (kept for inspection, never loaded or pruned) and the job says loudly that
    it falls back. ``explicit``: the user named the step, so there is no fallback. ``job``: this
    job's geometry, checked with ``check_geometry``; None for a reader of the model weights alone
    (``evaluate``), which load at any geometry.
    """
    rejected: list[tuple[Path, str]] = []
    for step in candidates:
        path = folder / f"step-{step}"
        if job is not None:
            check_geometry(path, job)
        problems = verify(path)
        if not problems:
            if rejected:
                on_rank0(lambda: _set_aside(rejected, path))  # noqa: B023 (called at once)
            return path
        rejected.append((path, "; ".join(problems)))
        if explicit:
            break
    if rejected:
        raise JobError(
            "no good snapshot to resume from: "
            + " | ".join(f"{path}: {why}" for path, why in rejected)
            + "; move the damaged snapshots out of the checkpoint folder to start over, or pick "
            "another [checkpoint] load_step"
        )
    return None


def _set_aside(rejected: list[tuple[Path, str]], chosen: Path) -> None:
    for bad, why in rejected:
        aside = bad.with_name(bad.name + ".corrupt")
        while aside.exists():
            aside = aside.with_name(aside.name + "+")
        os.replace(bad, aside)
        logger.warning("snapshot %s is damaged: %s; renamed it to %s", bad, why, aside.name)
    logger.warning("falling back to the older snapshot %s", chosen)


def check_geometry(path: Path, job: dict[str, Any]) -> None:
    """Refuse a data-parallel degree other than the snapshot's: dp ranks consume documents at
    their own pace (document i goes to dp rank i mod dp), so there is no single position in the
    corpus to re-split, and any re-split would skip or repeat documents."""
    saved = (read_manifest(path) or {}).get("job", {})
    if "dp" in saved and saved["dp"] != job["dp"]:
        world = job["world_size"]
        same_dp = (
            f"e.g. --parallelism.context_parallel_degree {world // saved['dp']} on these "
            f"{world} processes; "
            if world % saved["dp"] == 0
            else ""
        )
        raise ConfigError(
            f"snapshot {path} was saved with data-parallel degree {saved['dp']} (cp {saved['cp']} "
            f"on {saved['world_size']} processes), this job has data-parallel degree {job['dp']} "
            f"(cp {job['cp']} on {world}): the data loader's position cannot be re-split exactly. "
            f"Resume with data-parallel degree {saved['dp']} ({same_dp}any cp or tp degree "
            "works), or use another [job] dump_folder"
        )


class _ModelAndOptimizer(Stateful):
    def __init__(self, model: nn.Module, optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )


class _Pickled(Stateful):
    """Small Python state as one opaque value under ``key`` (per data-parallel rank if needed)."""

    def __init__(self, key: str, get, put) -> None:
        self.key, self.get, self.put = key, get, put

    def state_dict(self) -> dict:
        return {self.key: pickle.dumps(self.get())}

    def load_state_dict(self, state: dict) -> None:
        self.put(pickle.loads(state[self.key]))


class Checkpointer:
    """Saves and loads the job's state; ``job`` (the parallel geometry), ``model`` (the model's
    settings, ``model_record``), ``batch`` (what a step holds, ``batch_record``) and ``data()``
    (the fingerprint of the data consumed, collective) are recorded in each manifest, so that a
    resume with another data-parallel degree, other model settings, another step or on changed
    data can be refused up front, or said."""

    def __init__(
        self,
        folder: str,
        *,
        interval: int,
        keep_latest_k: int,
        model: nn.Module,
        optimizer,
        lr_scheduler,
        dataloader,
        dp_rank: int,
        job: dict[str, Any],
        data: Callable[[], dict[str, Any]] | None = None,
        model_settings: dict[str, Any] | None = None,
        batch: dict[str, Any] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.job = job
        self.model_settings = model_settings
        self.batch = batch
        self.data = data
        self.step = 0
        self.latest: Path | None = None
        """The newest snapshot known good: the one loaded, then each one saved."""
        self.snapshot_bytes = 0
        """Bytes of the latest snapshot (0 until one is loaded or saved)."""
        self.states = {
            "train": _ModelAndOptimizer(model, optimizer),
            "lr_scheduler": _Pickled(
                "state", lr_scheduler.state_dict, lr_scheduler.load_state_dict
            ),
            "dataloader": _Pickled(
                f"dp_rank_{dp_rank}", dataloader.state_dict, dataloader.load_state_dict
            ),
            "progress": _Pickled("state", lambda: self.step, self._set_step),
        }

    def _set_step(self, step: int) -> None:
        self.step = step

    def describe_latest(self) -> str:
        return (
            f"the last good snapshot is {self.latest}"
            if self.latest
            else "no snapshot was saved yet"
        )

    def load(self, path: Path) -> int:
        """Restore the snapshot at ``path``; returns its step."""
        dcp.load(self.states, checkpoint_id=str(path))
        self.latest = path
        files = (read_manifest(path) or {}).get("files", {})
        self.snapshot_bytes = sum(entry["bytes"] for entry in files.values()) or self.snapshot_bytes
        return self.step

    def maybe_save(self, step: int, *, last: bool) -> None:
        if step % self.interval == 0 or last:
            self.save(step)

    def save(self, step: int) -> Path:
        """Write ``step-N.partial``, its manifest, then publish it as ``step-N`` (collective)."""
        final, partial = self.folder / f"step-{step}", self.folder / f"step-{step}.partial"
        began = time.perf_counter()
        self.step = step
        on_rank0(
            lambda: shutil.rmtree(partial) if partial.exists() else None
        )  # a killed save's debris
        try:
            record = {"step": step, "job": self.job}
            if self.model_settings is not None:
                record["model"] = self.model_settings
            if self.batch is not None:
                record["batch"] = self.batch
            if self.data is not None:
                record["data"] = self.data()
            dcp.save(self.states, checkpoint_id=str(partial))
            nbytes = write_manifest(partial, record)
        except (Exception, CheckpointException) as err:  # DCP's is a BaseException
            on_rank0(lambda: shutil.rmtree(partial, ignore_errors=True))
            if is_out_of_space(err):
                raise no_space_error(step, self.folder, self.snapshot_bytes, self.latest) from err
            raise
        on_rank0(lambda: self._publish(partial, final))
        self.latest, self.snapshot_bytes = final, nbytes
        logger.info(
            "saved step-%d to %s (%s in %.1f s)",
            step,
            final,
            human(nbytes),
            time.perf_counter() - began,
        )
        return final

    def _publish(self, partial: Path, final: Path) -> None:
        if final.exists():  # left by a run resumed from an older load_step: this one supersedes it
            old = final.with_name(final.name + ".replaced")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old)
        else:
            os.replace(partial, final)
        if self.keep_latest_k > 0:
            kept = snapshots(self.folder)
            for old_step in sorted(kept)[: -self.keep_latest_k]:
                shutil.rmtree(kept[old_step])
