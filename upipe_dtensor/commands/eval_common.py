"""What both evaluations (loss by position, ``evaluate``; retrieval, ``retrieval``) share: the job's
model with the weights a resuming job would take, and how their outputs are named and written.

Its own module so ``evaluate`` (whose ``--task`` runs ``retrieval``) and ``retrieval`` both
import it and not each other.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch.distributed as dist

from upipe_dtensor.checkpointing.model_record import check_model_unchanged
from upipe_dtensor.checkpointing.outputs import writing_file
from upipe_dtensor.checkpointing.snapshots import choose_snapshot, snapshot_candidates
from upipe_dtensor.checkpointing.weights import load_dcp_weights
from upipe_dtensor.config import ConfigError, JobConfig
from upipe_dtensor.config.checks import initial_load_folder
from upipe_dtensor.models.hf_config import model_args
from upipe_dtensor.train.build import (
    ParallelModel,
    build_parallel_model,
    load_initial_weights,
    set_up_job,
)


def load_eval_weights(built: ParallelModel, snapshot: Path | None) -> str:
    """The model part of ``snapshot``, else the job's initial weights; a description."""
    if snapshot is not None:
        load_dcp_weights(built.model, str(snapshot))
        return f"snapshot {snapshot}"
    return load_initial_weights(built)


def load_job_model(config: JobConfig) -> tuple[ParallelModel, Path | None, str]:
    """The job's model, built and parallelised as train.py builds it, with the weights a resuming
    job would take: (model, the snapshot or None for the initial weights, a description).
    ConfigError, before any process group, when there are no weights at all. The blocks run
    eager whatever [compile] says: an evaluation runs each of its lengths a few times, and every
    length would be another compiled graph (fullgraph fails past dynamo's recompile limit)."""
    config = dataclasses.replace(config, compile=dataclasses.replace(config.compile, enable=False))
    folder = Path(config.job.dump_folder) / config.checkpoint.folder
    candidates = snapshot_candidates(config, folder)  # folder names only: no process group yet
    if not candidates and not initial_load_folder(config):
        raise ConfigError(
            f"{config.config_file}: no weights to evaluate: no snapshot in {folder} and no "
            "[checkpoint] initial_load_path; train first, or set initial_load_path (with "
            "initial_load_in_hf for a Hugging Face folder)"
        )
    setup = set_up_job(config)
    snapshot = (
        choose_snapshot(folder, candidates, explicit=config.checkpoint.load_step != -1, job=None)
        if candidates
        else None
    )
    if snapshot is not None:
        args = model_args(config.model, config.training.seq_len)
        check_model_unchanged(snapshot, config, args, rank0=dist.get_rank() == 0)
    built = build_parallel_model(config, setup)
    return built, snapshot, load_eval_weights(built, snapshot)


def weights_tag(config: JobConfig, snapshot: Path | None) -> str:
    """The weights in an output's name: the snapshot (``step-N``), else the initial weights."""
    if snapshot is not None:
        return snapshot.name
    return "hf" if config.checkpoint.initial_load_in_hf else "dcp"


def write_outputs(paths: tuple[Path, Path], record: dict, plot, *, overwrite: bool) -> None:
    """The JSON ``record`` and the plot (``plot(path)`` draws it), each written under a temporary
    name and renamed into place; an existing file is replaced only with ``overwrite``."""
    picture, result = paths
    with writing_file(result, overwrite=overwrite) as temporary:
        temporary.write_text(json.dumps(record, indent=1) + "\n")
    with writing_file(picture, overwrite=overwrite) as temporary:
        plot(temporary)
