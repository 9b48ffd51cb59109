"""What a training job checks before the expensive part, so a mistake is one line in seconds:
before any process group the config, the export target, the initial weights, the optional
packages it asks for and every record of the local data; after set-up, the first document of
this rank's data loader."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch.distributed as dist

from upipe_dtensor.checkpointing.snapshots import snapshots
from upipe_dtensor.checkpointing.weights import unloaded_hf_weights
from upipe_dtensor.config import ConfigError, JobConfig, check_job
from upipe_dtensor.config.checks import data_error
from upipe_dtensor.data.checks import DataScan, scan_sources
from upipe_dtensor.data.loader import PackedTextLoader, hub_unreachable
from upipe_dtensor.data.startup_warnings import data_warnings
from upipe_dtensor.runtime.metrics import WANDB_MISSING, wandb_missing
from upipe_dtensor.train.export import check_export_target
from upipe_dtensor.train.setup import JobSetup

logger = logging.getLogger(__name__)


def check_before_process_group(config: JobConfig) -> DataScan | None:
    """The config, the outputs, the weights, then the data, before any process group: mistakes
    that take no reading first, then every local record (``check_data``). Returns the scan of
    the local data (None for a Hub dataset)."""
    world_size = (
        dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    )
    dp = check_job(config, world_size)
    check_export_target(config)
    check_initial_weights(config)
    if config.metrics.enable_wandb and wandb_missing():
        raise ConfigError(f"{config.source_of('metrics.enable_wandb')}: {WANDB_MISSING}")
    return check_data(config, dp)


def check_initial_weights(config: JobConfig) -> None:
    """A job that starts fresh from the seed's weights beside a folder of pretrained ones says
    which it means (``weights.unloaded_hf_weights``); a job resuming from its snapshots loads
    neither."""
    folder = Path(config.job.dump_folder) / config.checkpoint.folder
    if config.checkpoint.enable and snapshots(folder):
        return
    if why := unloaded_hf_weights(config):
        keys = ("model.hf_assets_path", "model.flavor", "checkpoint.initial_load_in_hf")
        raise ConfigError(f"{config.source_of(*keys)}: {why}")


def check_data(config: JobConfig, dp: int) -> DataScan | None:
    """Every record of the local training data, read once: bad records are a ConfigError naming
    the first few by file and line, or, with [training] skip_bad_records, skipped and counted in
    a warning; data that will train badly gets a warning line (``data.startup_warnings``). A
    token folder is not read (its manifest stands for it). A Hugging Face dataset is only
    probed: an unreachable Hub fails in seconds. Rank 0 alone warns (every rank scans alike)."""
    training = config.training
    try:
        if training.dataset != "local":
            if why := hub_unreachable(training.dataset):
                raise ValueError(why)
            return None
        scan = scan_sources([s.path for s in training.data_sources], training.dataset_text_field)
    except ValueError as err:
        raise data_error(config, str(err)) from err
    if scan.bad_count and (not training.skip_bad_records or scan.emptied_sources):
        raise data_error(config, f"{scan.bad_summary()}; {scan.bad_records_fix()}")
    if os.environ.get("RANK", "0") != "0":
        return scan
    if scan.bad_count:
        logger.warning("skipping %s ([training] skip_bad_records = true)", scan.bad_summary())
    try:
        for line in data_warnings(config, scan, dp):
            logger.warning(line)
    except ValueError as err:  # the tokenizer, which every rank reports after set-up
        logger.debug("no data warnings: %s", err)
    return scan


def checked_loader(config: JobConfig, setup: JobSetup) -> PackedTextLoader:
    """The data loader, after reading up to this rank's first document: an empty corpus or a bad
    first record is a ConfigError now, not a traceback after the model is built."""
    training = config.training
    try:
        loader = PackedTextLoader(
            dataset=training.dataset,
            dataset_path=training.dataset_path,
            dataset_config_name=training.dataset_config_name,
            split=training.dataset_split,
            text_field=training.dataset_text_field,
            tokenizer=setup.tokenizer,
            seq_len=training.seq_len,
            batch_size=training.local_batch_size,
            dp_rank=setup.dp_rank,
            dp_world_size=setup.dp,
            skip_bad_records=training.skip_bad_records,
            sources=training.sources,
            seed=training.seed,
        )
        loader.check_first_document()
    except ValueError as err:
        raise data_error(config, str(err), "model.tokenizer_path") from err
    return loader
