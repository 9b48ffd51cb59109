"""Job checks: combinations of keys that cannot run, found before any process group exists.

Each check names where the offending values were set (file or command line) and a fix. The
checks of things that live elsewhere are asked of their owners: the model shape of
``models.hf_config``, a CP style's options and their geometry of the style
(``parallel.style_options``, through the registry). The initial weights' check is here
(``check_initial_load``, with ``initial_load_folder``): it reads only the folder's files (the
safetensors headers and config.json, through ``models.hf_config``), so the config layer stays
below ``checkpointing``, which reads the job's config (``tests/test_layering.py``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from upipe_dtensor.config.schema import ConfigError, JobConfig, source_label
from upipe_dtensor.models.family import family_of
from upipe_dtensor.models.hf_config import (
    ModelArgs,
    check_safetensors,
    hf_shape_mismatch,
    model_args,
    read_hf_config,
)
from upipe_dtensor.parallel.style_options import Geometry, OptionError


def _check_finite(config: JobConfig, fail) -> None:
    """Every number of every section is finite: ``--optimizer.lr nan`` passes each range check
    (comparisons with nan are false) and trains to a nan loss; inf is no setting either."""
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        if not dataclasses.is_dataclass(values):
            continue
        for key in dataclasses.fields(values):
            value = getattr(values, key.name)
            if isinstance(value, float) and not math.isfinite(value):
                fail(
                    f"[{section.name}] {key.name} = {value} is not a finite number; give it a "
                    f"number (the default is {key.default!r})",
                    f"{section.name}.{key.name}",
                )


def _check_positive(config: JobConfig, fail) -> None:
    for section, key, minimum in (
        ("training", "steps", 1),
        ("training", "seq_len", 1),
        ("training", "local_batch_size", 1),
        ("training", "gradient_accumulation_steps", 1),
        ("parallelism", "context_parallel_degree", 1),
        ("parallelism", "ring_degree", 1),
        ("parallelism", "tensor_parallel_degree", 1),
        ("parallelism", "expert_parallel_degree", 1),
        ("lr_scheduler", "warmup_steps", 0),
        ("checkpoint", "interval", 1),
        ("checkpoint", "keep_latest_k", 0),
        ("metrics", "log_freq", 1),
        ("activation_checkpoint", "cpu_offload_skip_last", 0),
        ("activation_checkpoint", "keep_attention_skip_first", 0),
        ("activation_checkpoint", "blocks_per_checkpoint", 1),
        ("memory", "mlp_tile_tokens", 0),
        ("memory", "norm_tile_tokens", 0),
        ("memory", "loss_chunk_tokens", 1),
        ("model", "rope_theta", 0),
        ("model", "rope_scaling_factor", 0),
        ("model", "rope_low_freq_factor", 0),
        ("model", "rope_high_freq_factor", 0),
        ("model", "rope_original_max_position_embeddings", 0),
    ):
        value = getattr(getattr(config, section), key)
        if value < minimum:
            fail(f"[{section}] {key} = {value} must be >= {minimum}", f"{section}.{key}")
    if config.optimizer.lr <= 0:
        fail(f"[optimizer] lr = {config.optimizer.lr} must be > 0", "optimizer.lr")
    if config.training.max_norm < 0:
        fail(
            f"[training] max_norm = {config.training.max_norm} must be >= 0 (0 disables clipping)",
            "training.max_norm",
        )
    if not 0 <= config.lr_scheduler.min_lr_factor <= 1:
        fail(
            f"[lr_scheduler] min_lr_factor = {config.lr_scheduler.min_lr_factor} must be in [0, 1]",
            "lr_scheduler.min_lr_factor",
        )
    if config.job.stop_grace_seconds <= 0:
        fail(
            f"[job] stop_grace_seconds = {config.job.stop_grace_seconds} must be > 0",
            "job.stop_grace_seconds",
        )
    if config.checkpoint.load_step < -1 or config.checkpoint.load_step == 0:
        fail(
            f"[checkpoint] load_step = {config.checkpoint.load_step} must be -1 (the latest "
            "snapshot) or a snapshot's step",
            "checkpoint.load_step",
        )


_GEOMETRY_KEYS = {
    "n_heads": ("model.name", "model.flavor", "model.hf_assets_path"),
    "cp_degree": ("parallelism.context_parallel_degree",),
    "ring_degree": ("parallelism.ring_degree",),
    "seq_len": ("training.seq_len",),
    "tensor_parallel_degree": ("parallelism.tensor_parallel_degree",),
}
"""The keys that set each number a style's options are checked against (``Geometry``)."""


def _check_context_parallel(config: JobConfig, args, fail) -> None:
    """The mesh's ring axis, and cp_style's options on the model's heads and the mesh (every rule
    is the style's: ``parallel.style_options``)."""
    parallelism = config.parallelism
    cp, ring, style = (
        parallelism.context_parallel_degree,
        parallelism.ring_degree,
        parallelism.cp_style,
    )
    if ring < 1 or cp % ring:
        divisors = [r for r in range(1, cp + 1) if cp % r == 0]
        fail(
            f"[parallelism] ring_degree = {ring} must divide context_parallel_degree = {cp}; "
            f"use one of {divisors}",
            "parallelism.ring_degree",
            "parallelism.context_parallel_degree",
        )
    spec = parallelism.style
    try:
        options = spec.options_from(parallelism.style_options)
    except OptionError as err:
        fail(f"[parallelism] {err}", *(f"parallelism.{key}" for key in err.names))
    geometry = Geometry(
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads or args.n_heads,
        cp_degree=cp,
        ring_degree=ring,
        seq_len=config.training.seq_len,
        tp_degree=parallelism.tensor_parallel_degree,
    )
    try:
        options.check(geometry)
    except OptionError as err:
        axis = (
            f"a head axis of {parallelism.head_degree} ranks (C / ring_degree)"
            if ring > 1
            else f"cp degree {cp}"
        )
        on = f" over {axis}, flavor {config.model.flavor!r}" if "n_heads" in err.names else ""
        keys = [
            key for name in err.names for key in _GEOMETRY_KEYS.get(name, (f"parallelism.{name}",))
        ]
        fail(f"[parallelism] cp_style {style!r}{on}: {err}", *keys)


def _check_expert_parallel(config: JobConfig, args, token_ranks: int, fail) -> None:
    """[parallelism] expert_parallel_degree: a mixture of experts' experts over groups of
    ranks that hold other tokens (dp_shard x cp), each group holding every expert once."""
    ep, key = config.parallelism.expert_parallel_degree, "parallelism.expert_parallel_degree"
    if ep == 1:
        return
    if not family_of(args).mixture_of_experts:
        fail(
            f"[parallelism] expert_parallel_degree = {ep}: {config.model.name} has no experts; "
            "set expert_parallel_degree = 1",
            key,
            "model.name",
        )
    if token_ranks % ep:
        fail(
            f"[parallelism] expert_parallel_degree = {ep} does not divide the {token_ranks} "
            "ranks of data_parallel_shard_degree x context_parallel_degree it is taken from; "
            f"use one of {[d for d in range(1, token_ranks + 1) if token_ranks % d == 0]}",
            key,
            "parallelism.context_parallel_degree",
            "parallelism.data_parallel_shard_degree",
        )
    if args.num_experts % ep:
        fail(
            f"[parallelism] expert_parallel_degree = {ep} does not divide the model's "
            f"{args.num_experts} experts; use a divisor of {args.num_experts}",
            key,
            "model.flavor",
        )


def _check_sources(config: JobConfig, fail) -> None:
    """[[training.sources]]: local files, not beside dataset_path; each one's path, weight and
    upsampling."""
    training, key = config.training, "training.sources"
    if training.dataset != "local":
        fail(
            f"[[training.sources]] are local files, but [training] dataset = {training.dataset!r} "
            "names a Hugging Face dataset; set dataset = 'local' or remove the "
            "[[training.sources]] tables",
            key,
            "training.dataset",
        )
    if "training.dataset_path" in config.sources and config.set_after("training.dataset_path", key):
        fail(
            f"[training] dataset_path = {training.dataset_path!r} and [[training.sources]] both "
            "name the training data; make the path a [[training.sources]] table (path = "
            f"{training.dataset_path!r}) or remove dataset_path (one set in a file that the "
            "sources' file extends is overridden by them)",
            "training.dataset_path",
            key,
        )
    for number, source in enumerate(training.sources, 1):
        label = source_label(number)
        if not source.path:
            fail(f"{label} has no path; add path = a .txt/.jsonl/.parquet file or folder", key)
        if not os.path.exists(source.path):
            fail(
                f"{label} path = {source.path!r} does not exist; point it at a "
                ".txt/.jsonl/.parquet file or folder",
                key,
            )
        if not (math.isfinite(source.weight) and source.weight > 0):
            fail(
                f"{label} weight = {source.weight} must be a finite number > 0: the source's "
                "share of the mixture's tokens is its weight / the sum of the weights (e.g. 1.0)",
                key,
            )
        if source.upsample_factor < 1:
            fail(
                f"{label} upsample_factor = {source.upsample_factor} must be >= 1 (1: no "
                "upsampling)",
                key,
            )
        if source.upsample_min_tokens < 0:
            fail(f"{label} upsample_min_tokens = {source.upsample_min_tokens} must be >= 0", key)
        if source.upsample_factor > 1 and source.upsample_min_tokens == 0:
            fail(
                f"{label} upsample_factor = {source.upsample_factor} repeats the documents of at "
                "least upsample_min_tokens tokens, and upsample_min_tokens = 0 makes that every "
                "document; set upsample_min_tokens to the length from which a document is long",
                key,
            )


def _check_data(config: JobConfig, fail) -> None:
    """The training data's settings: the dataset name, and dataset_path or [[training.sources]].
    Reading the data is ``data.checks``'s."""
    training = config.training
    dataset = training.dataset
    if not dataset.strip() or dataset != dataset.strip():
        fail(
            f"[training] dataset = {dataset!r}: use 'local' (files at dataset_path) or a Hugging "
            "Face dataset name without surrounding spaces",
            "training.dataset",
        )
    hub_keys = ("training.dataset_config_name", "training.dataset_split")
    if dataset == "local" and any(key in config.sources for key in hub_keys):
        fail(
            "[training] dataset_config_name and dataset_split choose a Hugging Face dataset's "
            "subset and split, but dataset = 'local' reads files; remove them or set dataset to "
            "the Hugging Face dataset's name",
            *hub_keys,
            "training.dataset",
        )
    if training.sources:
        _check_sources(config, fail)
    elif dataset == "local" and not os.path.exists(training.dataset_path):
        fail(
            f"[training] dataset_path = {training.dataset_path!r} does not exist; point it at a "
            f".txt/.jsonl/.parquet file or folder, or set dataset to a Hugging Face dataset name",
            "training.dataset_path",
        )


def _check_compile(config: JobConfig, fail) -> None:
    """With ``[compile] enable``, a backend torch.compile does not know would fail on every rank
    after the model is built; ask dynamo's registry, which torch.compile itself looks names up in
    (the backend is read only when compiling)."""
    from upipe_dtensor.runtime.torch_private import InvalidBackend, list_backends, lookup_backend

    backend = config.compile.backend
    if not config.compile.enable:
        return
    try:
        lookup_backend(backend)
    except InvalidBackend:
        fail(
            f"[compile] backend = {backend!r} is not a torch.compile backend; use one of "
            f"{list_backends()} ('inductor', the default, generates kernels) or a debugging one "
            "such as 'eager' or 'aot_eager' (torch._dynamo.list_backends(exclude_tags=()) lists "
            "them all)",
            "compile.backend",
        )


def initial_load_folder(config: JobConfig) -> str:
    """The folder [checkpoint] initial_load_path names (hf_assets_path for an HF load without
    one), or "" when the job starts from the seed's initial weights."""
    checkpoint = config.checkpoint
    if checkpoint.initial_load_in_hf:
        return checkpoint.initial_load_path or config.model.hf_assets_path
    return checkpoint.initial_load_path


def check_initial_load(config: JobConfig, args: ModelArgs) -> None:
    """ValueError naming the key and a fix when the initial weights cannot be loaded into
    ``args``."""
    checkpoint = config.checkpoint
    folder = initial_load_folder(config)
    if checkpoint.initial_load_in_hf and not folder:
        raise ValueError(
            "[checkpoint] initial_load_in_hf needs a Hugging Face folder: set [checkpoint] "
            "initial_load_path or [model] hf_assets_path"
        )
    if not folder:
        return
    if not Path(folder).is_dir():
        raise ValueError(f"[checkpoint] initial_load_path = {folder!r} is not a folder")
    if not checkpoint.initial_load_in_hf:
        if not (Path(folder) / ".metadata").is_file():
            raise ValueError(
                f"[checkpoint] initial_load_path = {folder!r} is not a DCP checkpoint (no "
                ".metadata); "
                f"for a Hugging Face folder set initial_load_in_hf = true"
            )
        return
    if not any(Path(folder).glob("*.safetensors")):
        raise ValueError(
            f"{folder} holds no *.safetensors weights to load ([checkpoint] initial_load_in_hf)"
        )
    check_safetensors(folder)
    mismatch = hf_shape_mismatch(args, read_hf_config(folder))
    if mismatch:
        raise ValueError(
            f"the model to train and the weights in {folder}/config.json differ: {mismatch}"
        )


def _failer(config: JobConfig):
    """The ``fail(reason, *keys)`` of the checks: ``keys`` are the ``"section.key"`` values at
    fault, and the ConfigError names where they were set."""

    def fail(reason: str, *keys: str) -> None:
        raise ConfigError(f"{config.source_of(*keys)}: {reason}")

    return fail


DATA_KEYS = (
    "training.dataset",
    "training.dataset_config_name",
    "training.dataset_split",
    "training.dataset_path",
    "training.dataset_text_field",
    "training.sources",
)
"""The keys that choose a job's training text: an error found in the text blames where they were
set."""


def data_error(config: JobConfig, problem: str, *more_keys: str) -> ConfigError:
    """An error in the training text, naming the file or flag that chose it (and ``more_keys``'
    sources: the tokenizer's, where it read the text)."""
    return ConfigError(f"{config.source_of(*DATA_KEYS, *more_keys)}: [training] data: {problem}")


def check_training_data(config: JobConfig) -> None:
    """The data settings alone (``check_job`` checks them too), for commands that read the data
    without training (``data_report``)."""
    _check_data(config, _failer(config))


def check_job(config: JobConfig, world_size: int) -> int:
    """Reject impossible combinations before any heavy work; returns the dp_shard degree."""
    fail = _failer(config)
    _check_finite(config, fail)
    _check_positive(config, fail)
    parallelism, training = config.parallelism, config.training
    cp, tp = parallelism.context_parallel_degree, parallelism.tensor_parallel_degree
    cp_key, dp_key = "parallelism.context_parallel_degree", "parallelism.data_parallel_shard_degree"
    tp_key = "parallelism.tensor_parallel_degree"
    model_parallel = cp * tp
    tp_keys = (tp_key,) if tp > 1 else ()
    named = f"context_parallel_degree {cp}" + (f" x tensor_parallel_degree {tp}" if tp > 1 else "")
    degrees = f"context_parallel_degree = {cp}" + (
        f" x tensor_parallel_degree = {tp}" if tp > 1 else ""
    )
    if world_size % model_parallel:
        fail(
            f"[parallelism] {degrees} does not divide the {world_size} launched processes; launch "
            f"a multiple of {model_parallel} or change the degree" + ("s" if tp > 1 else ""),
            cp_key,
            *tp_keys,
        )
    dp = parallelism.data_parallel_shard_degree
    if dp == -1:
        dp = world_size // model_parallel
    if dp * model_parallel != world_size:
        fail(
            f"[parallelism] data_parallel_shard_degree {dp} x {named} = {dp * model_parallel} != "
            f"{world_size} launched processes; set data_parallel_shard_degree = "
            f"{world_size // model_parallel} (or -1)",
            dp_key,
            cp_key,
            *tp_keys,
        )
    if training.seq_len % model_parallel:
        fail(
            f"[training] seq_len = {training.seq_len} is not divisible by {degrees}"
            + (" (each CP shard is split over the tensor-parallel ranks)" if tp > 1 else "")
            + f"; use a multiple of {model_parallel}, e.g. "
            f"{training.seq_len // model_parallel * model_parallel or model_parallel}",
            "training.seq_len",
            cp_key,
            *tp_keys,
        )
    model_keys = ("model.name", "model.flavor", "model.hf_assets_path", "training.seq_len")
    try:
        args = model_args(config.model, training.seq_len)
    except ValueError as err:
        fail(str(err), *model_keys)
    _check_expert_parallel(config, args, dp * cp, fail)
    if tp > 1 and family_of(args).mixture_of_experts:
        fail(
            f"[parallelism] tensor_parallel_degree = {tp}: the {config.model.name} family's "
            f"experts do not run under tensor parallelism here; set tensor_parallel_degree = 1 "
            f"(context parallelism splits the sequence, FSDP the experts)",
            tp_key,
            "model.name",
        )
    try:
        check_initial_load(config, args)
    except ValueError as err:
        fail(str(err), "checkpoint.initial_load_path", "checkpoint.initial_load_in_hf", *model_keys)
    if config.activation_checkpoint.cpu_offload and config.activation_checkpoint.mode != "full":
        fail(
            "[activation_checkpoint] cpu_offload moves the inputs that full checkpointing keeps; "
            "set mode = 'full' as well",
            "activation_checkpoint.cpu_offload",
            "activation_checkpoint.mode",
        )
    if (
        config.activation_checkpoint.keep_attention != "none"
        and config.activation_checkpoint.mode != "full"
    ):
        fail(
            "[activation_checkpoint] keep_attention spares the recompute of full checkpointing; "
            "set mode = 'full' as well (without checkpointing attention is never recomputed)",
            "activation_checkpoint.keep_attention",
            "activation_checkpoint.mode",
        )
    skip_first = config.activation_checkpoint.keep_attention_skip_first
    if skip_first and config.activation_checkpoint.keep_attention == "none":
        fail(
            f"[activation_checkpoint] keep_attention_skip_first = {skip_first} chooses which "
            "blocks keep their attention, but keep_attention = 'none' keeps none; set "
            "keep_attention = 'host' or 'device', or keep_attention_skip_first = 0",
            "activation_checkpoint.keep_attention_skip_first",
            "activation_checkpoint.keep_attention",
        )
    if skip_first >= args.n_layers:
        fail(
            f"[activation_checkpoint] keep_attention_skip_first = {skip_first} leaves none of "
            f"the model's {args.n_layers} blocks keeping its attention; use at most "
            f"{args.n_layers - 1}, or keep_attention = 'none'",
            "activation_checkpoint.keep_attention_skip_first",
            "model.flavor",
        )
    if (
        config.activation_checkpoint.blocks_per_checkpoint > 1
        and config.activation_checkpoint.mode != "full"
    ):
        fail(
            "[activation_checkpoint] blocks_per_checkpoint groups blocks for full checkpointing; "
            "set mode = 'full' as well",
            "activation_checkpoint.blocks_per_checkpoint",
            "activation_checkpoint.mode",
        )
    _check_context_parallel(config, args, fail)
    if parallelism.attention_backend == "cudnn" and training.attention_mask == "document":
        fail(
            "[parallelism] attention_backend = 'cudnn' cannot mask documents (aten's cuDNN "
            "attention has no varlen path); use 'flash' or 'sdpa' with [training] attention_mask "
            "= 'document'",
            "parallelism.attention_backend",
            "training.attention_mask",
        )
    _check_compile(config, fail)
    _check_data(config, fail)
    if not os.path.exists(config.model.tokenizer_folder):
        fail(
            f"[model] tokenizer_path = {config.model.tokenizer_path!r} (hf_assets_path = "
            f"{config.model.hf_assets_path!r}) does not exist; point it at a folder with a "
            f"Hugging Face tokenizer.json",
            "model.tokenizer_path",
            "model.hf_assets_path",
        )
    if not config.job.dump_folder.strip():
        fail(
            "[job] dump_folder is empty; name a folder for logs and checkpoints", "job.dump_folder"
        )
    return dp
