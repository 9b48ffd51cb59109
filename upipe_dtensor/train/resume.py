"""A training job's snapshots: which one it resumes from, whether it may (the same data-parallel
degree, model settings and data as the snapshot's, or a change the job accepts; a step that holds
other than the snapshot's is said, or refused where the data position cannot follow), and the
checkpointer that saves the next ones, with its free-space report.

Decided before the model is built: the snapshot is chosen and checked from its manifest alone
(``checkpointing.snapshots``, ``checkpointing.model_record``, ``data.checks``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from upipe_dtensor.checkpointing.batch_record import batch_record, check_batch_change
from upipe_dtensor.checkpointing.manifest import read_manifest
from upipe_dtensor.checkpointing.model_record import check_model_unchanged, model_record
from upipe_dtensor.checkpointing.snapshots import (
    Checkpointer,
    choose_snapshot,
    resume_candidates,
    snapshots,
)
from upipe_dtensor.checkpointing.storage import snapshot_bytes_estimate, space_report
from upipe_dtensor.config import ConfigError, JobConfig
from upipe_dtensor.data.checks import data_changes
from upipe_dtensor.data.loader import PackedTextLoader
from upipe_dtensor.runtime.collectives import on_every_rank, on_rank0
from upipe_dtensor.train.setup import JobSetup

logger = logging.getLogger(__name__)

NO_CHECKPOINTS = "checkpointing is off: nothing to resume from"


def job_geometry(config: JobConfig, setup: JobSetup) -> dict[str, Any]:
    """The layout a snapshot records and a resume compares (``snapshots.check_geometry``)."""
    return {
        "dp": setup.dp,
        "cp": setup.cp,
        "tp": setup.tp,
        "world_size": setup.world_size,
        "cp_style": config.parallelism.cp_style,
    }


def snapshot_step(snapshot: Path) -> int:
    """The step a ``step-N`` snapshot folder holds."""
    return int(snapshot.name.split("-")[1])


def choose_resume(config: JobConfig, folder: Path, job: dict[str, Any]) -> Path | None:
    """The snapshot to resume from (collective): ``[checkpoint] load_step``'s, else the newest
    good one; None to start fresh. A finished job raises ``JobComplete``; damaged snapshots are
    reported and set aside (``snapshots.choose_snapshot``)."""
    if not config.checkpoint.enable:
        return None
    return choose_snapshot(
        folder,
        resume_candidates(config, folder),
        explicit=config.checkpoint.load_step != -1,
        job=job,
    )


def check_resumable(
    snapshot: Path,
    setup: JobSetup,
    fingerprint: dict[str, Any],
    dataloader: PackedTextLoader,
) -> None:
    """Refuse (``ConfigError``, every rank) a snapshot trained with other model settings or on
    other data, unless the job accepts the change (``[checkpoint] accept_model_change``,
    ``accept_data_change``), which is then a warning; a step that holds other than the
    snapshot's is said in one line, or refused where its data position cannot follow
    (``batch_record``)."""
    config, rank0 = setup.config, dist.get_rank() == 0
    check_model_unchanged(snapshot, config, setup.args, rank0=rank0)
    check_batch_change(snapshot, config, setup.dp, snapshot_step(snapshot), rank0=rank0)
    on_every_rank(
        lambda: check_data_unchanged(snapshot, config, fingerprint, setup.dp_rank, dataloader)
    )


def check_data_unchanged(
    snapshot: Path,
    config: JobConfig,
    fingerprint: dict[str, Any],
    dp_rank: int,
    dataloader: PackedTextLoader,
) -> None:
    """Refuse to resume on data other than the snapshot consumed (unless [checkpoint]
    accept_data_change): the loader's position is a document index, which on other data
    points elsewhere. Snapshots written before fingerprints existed are not checked."""
    saved = (read_manifest(snapshot) or {}).get("data")
    if saved is None:
        return
    changes = data_changes(saved, fingerprint, dp_rank, dataloader.documents)
    if not changes:
        return
    if not config.checkpoint.accept_data_change:
        raise ConfigError(
            f"the training data changed since snapshot {snapshot} was saved: {changes}. "
            "Restore the data, or set [checkpoint] accept_data_change = true to resume on the "
            "data as it is now, or set another [job] dump_folder to start over"
        )
    if dist.get_rank() == 0:  # every rank finds it: said once
        logger.warning(
            "the training data changed since snapshot %s was saved: %s; resuming on it "
            "([checkpoint] accept_data_change = true)",
            snapshot,
            changes,
        )


def resume_hint(checkpointer: Checkpointer | None) -> str:
    """What a run stopped now would resume from, for stop and failure lines."""
    return NO_CHECKPOINTS if checkpointer is None else checkpointer.describe_latest()


def job_checkpointer(
    config: JobConfig,
    setup: JobSetup,
    folder: Path,
    *,
    model: nn.Module,
    optimizer,
    lr_scheduler,
    dataloader: PackedTextLoader,
    data: Callable[[], dict[str, Any]],
    start_step: int,
) -> Checkpointer:
    """The checkpointer of ``[checkpoint]``, after one start-up line on the free space the
    remaining saves need (a warning if they will not fit; ``JobError`` if not even the next one
    does). ``data``: the fingerprint of the data consumed, for each manifest (collective)."""
    checkpoint = config.checkpoint
    checkpointer = Checkpointer(
        str(folder),
        interval=checkpoint.interval,
        keep_latest_k=checkpoint.keep_latest_k,
        model=model,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        dataloader=dataloader,
        dp_rank=setup.dp_rank,
        job=job_geometry(config, setup),
        data=data,
        model_settings=model_record(config, setup.args),
        batch=batch_record(config),
    )
    checkpointer.snapshot_bytes = snapshot_bytes_estimate(model)
    line, fits = on_rank0(
        lambda: space_report(
            folder,
            checkpointer.snapshot_bytes,
            checkpoint.keep_latest_k,
            kept=len(snapshots(folder)),
            saves_left=saves_left(config, start_step),
        )
    )
    if fits:
        logger.info(line)
    elif dist.get_rank() == 0:  # every rank has the same line: said once
        logger.warning(line)
    return checkpointer


def saves_left(config: JobConfig, start_step: int) -> int:
    """The snapshots a job started at ``start_step`` still writes: every interval, and the last
    step's."""
    interval, steps = config.checkpoint.interval, config.training.steps
    periodic = steps // interval - start_step // interval
    return periodic + (steps % interval != 0)
