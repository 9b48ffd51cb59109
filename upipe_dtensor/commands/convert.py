"""Convert model weights between our checkpoints and Hugging Face folders.

    # a training snapshot (or model-only checkpoint) -> a Hugging Face folder transformers loads
    python -m upipe_dtensor.convert --to hf outputs/job/checkpoint/step-1000 exported/ \\
        --config job.toml
    # a Hugging Face folder -> a model-only DCP checkpoint ([checkpoint] initial_load_path)
    python -m upipe_dtensor.convert --to dcp /models/Llama-3.1-8B llama31_8b_dcp/

``--to hf`` needs the model's shape and RoPE settings: pass the job's config (and any
``--section.key value`` it was trained with), or at least ``--model.flavor`` (with
``--model.hf_assets_path`` for flavor 'hf'). config.json keeps the fields of ``hf_assets_path``'s
own config.json (token ids, ...), with the trained shape and RoPE written over them, and the
tokenizer files are copied. ``--to dcp`` reads the shape from the source's config.json.

TARGET must be new or empty: a folder that holds anything is refused, naming what is there.
``--overwrite`` replaces the files convert writes and keeps everything else. The output is written
to a hidden sibling of TARGET and moved into place when complete.

Conversion runs in one process on the CPU and holds the whole model in float32 host memory
(32 GiB for 8B). At the end of a training run, ``[checkpoint] last_save_in_hf = true`` writes the
same Hugging Face folder from the sharded model, each rank writing its own shards.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path

import torch

from upipe_dtensor.checkpointing.model_record import check_model_unchanged
from upipe_dtensor.checkpointing.outputs import kept_note, refuse_nonempty
from upipe_dtensor.checkpointing.weights import (
    hf_export_note,
    load_dcp_weights,
    load_hf_weights,
    save_dcp_weights,
    save_hf_weights,
)
from upipe_dtensor.config import OVERRIDES_HELP, ConfigError, parse_args
from upipe_dtensor.data.loader import job_tokenizer
from upipe_dtensor.models import LongContextModel, family_of
from upipe_dtensor.models.hf_config import (
    args_from_hf,
    check_safetensors,
    model_args,
    read_hf_config,
)
from upipe_dtensor.runtime.errors import run_main
from upipe_dtensor.train.build import check_tokenizer_fits
from upipe_dtensor.train.parallelize import DTYPES

logger = logging.getLogger(__name__)


def _empty_model(args) -> LongContextModel:
    with torch.device("meta"):
        model = family_of(args).model_class(args)
    return model.to_empty(device="cpu")


def to_hf(
    source: str, target: str, argv: list[str], dtype: str | None, *, overwrite: bool = False
) -> str:
    """A DCP snapshot or model-only checkpoint -> a Hugging Face folder."""
    config = parse_args(argv)
    if config.config_file is None and not any(a.startswith("--model.flavor") for a in argv):
        raise ConfigError(
            "--to hf needs the model's shape: pass --config JOB.toml (the job that wrote the "
            "snapshot) or --model.flavor (8B, 32B, debugmodel, or hf with --model.hf_assets_path)"
        )
    try:
        args = model_args(config.model, config.training.seq_len)
    except ValueError as err:
        raise ConfigError(f"{config.config_file or 'command line'}: {err}") from err
    if not (Path(source) / ".metadata").is_file():
        raise ConfigError(
            f"{source} is not a DCP checkpoint (no .metadata); pass a step-N snapshot folder"
        )
    check_model_unchanged(Path(source), config, args, rank0=True)
    if not _holds_tokenizer(config.model.hf_assets_path):  # the export ships tokenizer_path's
        check_tokenizer_fits(config, job_tokenizer(config), args, exact=True)
    model = _empty_model(args)
    load_dcp_weights(model, source)
    kept = save_hf_weights(
        model,
        args,
        target,
        dtype=DTYPES[dtype or config.checkpoint.export_dtype],
        base_folder=config.model.hf_assets_path,
        tokenizer_folder=config.model.tokenizer_folder,
        overwrite=overwrite,
    )
    left_out = hf_export_note(model, args)
    note = f"\nnote: {left_out}" if left_out else ""
    return f"wrote the Hugging Face model to {target}{kept_note(kept, 'convert')}{note}"


def _holds_tokenizer(folder: str) -> bool:
    """Whether a Hugging Face folder ships its own tokenizer (the export copies it first)."""
    return bool(folder) and (Path(folder) / "tokenizer.json").is_file()


def to_dcp(source: str, target: str, *, overwrite: bool = False) -> str:
    """A Hugging Face folder -> a model-only DCP checkpoint."""
    try:
        args = args_from_hf(read_hf_config(source), f"{source}/config.json")
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if not any(Path(source).glob("*.safetensors")):
        raise ConfigError(f"{source} holds no *.safetensors weights")
    try:
        check_safetensors(source)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    model = _empty_model(args)
    load_hf_weights(model, args, source)
    kept = save_dcp_weights(model, target, overwrite=overwrite)
    return (
        f"wrote a model-only DCP checkpoint to {target}{kept_note(kept, 'convert')}; train from "
        f"it with [checkpoint] initial_load_path = {target!r} (and [model] flavor = 'hf', "
        f"hf_assets_path = {source!r})"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=OVERRIDES_HELP,
    )
    parser.add_argument(
        "source", help="snapshot folder (--to hf) or Hugging Face folder (--to dcp)"
    )
    parser.add_argument("target", help="folder to write: new or empty (see --overwrite)")
    parser.add_argument("--to", required=True, choices=["hf", "dcp"], help="output format")
    parser.add_argument(
        "--config", help="--to hf: the job .toml that wrote the snapshot (its model shape)"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="weight dtype of a Hugging Face export (default: [checkpoint] export_dtype)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty TARGET: replace the files convert writes, keep the rest",
    )
    args, rest = parser.parse_known_args(argv)
    with warnings.catch_warnings():  # one process, no process group: DCP warns on each call
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return run_main(lambda: _convert(args, rest))


def _convert(args: argparse.Namespace, rest: list[str]) -> None:
    if not args.overwrite:  # before anything is read: a mistyped target costs nothing
        refuse_nonempty(
            Path(args.target),
            "pass --overwrite to replace the files convert writes (everything else there is "
            "kept), or choose a new folder",
        )
    if args.to == "hf":
        config = ["--config", args.config] if args.config else []
        message = to_hf(
            args.source, args.target, [*config, *rest], args.dtype, overwrite=args.overwrite
        )
    else:
        if rest or args.config:
            unexpected = [*(["--config", args.config] if args.config else []), *rest]
            raise ConfigError(
                f"--to dcp reads everything from {args.source}; unexpected {unexpected}"
            )
        message = to_dcp(args.source, args.target, overwrite=args.overwrite)
    logger.info(message)
