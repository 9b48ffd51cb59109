"""The Hugging Face export after a job's last step (``[checkpoint] last_save_in_hf``): where it
goes, the start-up check that it replaces nothing, and the writing."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from upipe_dtensor.checkpointing.outputs import refuse_nonempty
from upipe_dtensor.checkpointing.weights import hf_export_note, save_hf_weights
from upipe_dtensor.config import JobConfig
from upipe_dtensor.models import LongContextModel
from upipe_dtensor.train.parallelize import DTYPES

logger = logging.getLogger(__name__)


def hf_export_folder(config: JobConfig, step: int) -> str:
    """{dump folder}/{checkpoint folder}/step-N-hf."""
    return os.path.join(config.job.dump_folder, config.checkpoint.folder, f"step-{step}-hf")


def check_export_target(config: JobConfig) -> None:
    """A ConfigError at start-up when the export after the last step would land on files it did
    not write (an earlier export, say): refused before any training, never replaced after."""
    if config.checkpoint.last_save_in_hf:
        refuse_nonempty(
            Path(hf_export_folder(config, config.training.steps)),
            "the Hugging Face export after the last step goes there and replaces nothing it did "
            "not write: move it away, or set [checkpoint] last_save_in_hf = false",
        )


def export_hf(model: LongContextModel, config: JobConfig, step: int) -> str:
    """Write the sharded ``model`` as a Hugging Face folder (collective); returns the folder."""
    folder = hf_export_folder(config, step)
    save_hf_weights(
        model,
        model.model_args,
        folder,
        dtype=DTYPES[config.checkpoint.export_dtype],
        base_folder=config.model.hf_assets_path,
        tokenizer_folder=config.model.tokenizer_folder,
    )
    logger.info("wrote the Hugging Face model to %s", folder)
    left_out = hf_export_note(model, model.model_args)
    if left_out:
        logger.warning("%s: %s", folder, left_out)
    return folder
