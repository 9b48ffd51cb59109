"""Model weights in and out: Hugging Face safetensors folders and model-only DCP checkpoints.

Everything goes through torch.distributed.checkpoint (DCP), so a sharded model reads and writes
only its own shards: DCP plans, for each rank, the slices of each stored tensor that overlap the
rank's DTensor shards, and the Hugging Face reader reads just those slices from the safetensors
files. No rank ever holds the whole model. The names (and Llama3's RoPE permutation) between
torchtitan's layout and Hugging Face's are the model family's torchtitan state-dict adapter
(``models.family.ModelFamily.state_dict_adapter``).

The same functions work on plain (unsharded) tensors, which is what ``convert`` uses.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import (
    FileSystemReader,
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from upipe_dtensor.checkpointing.outputs import publish_folder, temporary_sibling
from upipe_dtensor.errors import ConfigError
from upipe_dtensor.models.family import family_of
from upipe_dtensor.models.hf_config import (
    ModelArgs,
    check_safetensors,
    hf_config_for,
    read_hf_config,
)
from upipe_dtensor.models.long_context import LongContextModel
from upipe_dtensor.runtime.collectives import broadcast, on_rank0
from upipe_dtensor.runtime.torch_private import consolidate_safetensors_files_on_every_rank

T = TypeVar("T")

SNAPSHOT_MODEL_PREFIX = "train.model."
"""Where a training snapshot (``checkpoint.Checkpointer``) keeps the model's weights."""

HF_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
"""Files copied next to exported weights, so the folder is a complete Hugging Face model."""


def _by_columns(
    state: dict[str, torch.Tensor], permuted: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """``state`` with the weights the adapter permutes (Llama3's wq and wk) re-sharded by
    columns (input features).

    The adapter's RoPE permutation reorders rows within each head. FSDP2 shards rows, and when a
    rank's rows do not hold whole heads (8 KV heads on 16 ranks) DTensor cannot reorder them in
    place. Sharded by columns, every rank holds all rows of its columns: the permutation is local,
    and each rank still reads and writes only its 1/world of the weight. The re-sharding is an
    all-to-all on NCCL; gloo has none, and DTensor falls back to an all-gather there (one block's
    wq or wk whole on each CPU rank, briefly).
    """
    resharded = dict(state)
    for key, value in state.items():
        if permuted and key.endswith(permuted) and isinstance(value, DTensor):
            resharded[key] = value.redistribute(
                value.device_mesh, [Shard(1)] * value.device_mesh.ndim
            )
    return resharded


def _like(
    loaded: dict[str, torch.Tensor], model_state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``loaded`` with every DTensor back in the sharding of the model's own weight."""
    return {
        key: value.redistribute(model_state[key].device_mesh, model_state[key].placements)
        if isinstance(value, DTensor) and value.placements != model_state[key].placements
        else value
        for key, value in loaded.items()
    }


def _by_block(state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The state split into the top-level weights and one group per transformer block, so a load
    holds at most one block's permuted copies at a time."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        match = re.match(r"layers\.(\d+)\.", key)
        groups.setdefault(match.group(1) if match else "", {})[key] = value
    return list(groups.values())


def unloaded_hf_weights(config) -> str:
    """Why a job that would start from the seed's weights looks like a mistake ("" if not):
    [model] hf_assets_path holds safetensors weights, but no initial_load_path is given and
    initial_load_in_hf is not set either way. Training a pretrained model's folder from random
    weights is never what it looks like, so the job asks for the choice to be written down."""
    checkpoint, folder = config.checkpoint, config.model.hf_assets_path
    if not folder or checkpoint.initial_load_path or checkpoint.initial_load_in_hf:
        return ""
    if "checkpoint.initial_load_in_hf" in config.sources or not Path(folder).is_dir():
        return ""  # initial_load_in_hf = false written down: the seed's weights on purpose
    weights = sorted(Path(folder).glob("*.safetensors"))
    if not weights:
        return ""
    return (
        f"[model] hf_assets_path = {folder!r} holds Hugging Face weights ({len(weights)} "
        f"*.safetensors file{'s' * (len(weights) != 1)}), but this job would start from seed "
        f"{config.training.seed} initial weights: set [checkpoint] initial_load_in_hf = true to "
        "start from those weights, or initial_load_in_hf = false to train from the seed on purpose"
    )


def check_shapes(
    expected: dict[str, torch.Size],
    stored: dict[str, Any],
    source: str,
    *,
    prefix: str = "",
    complete: bool = True,
) -> None:
    """ConfigError when the weights stored in ``source`` (DCP metadata by name) are not the
    configured model's, as in a checkpoint of another model: a weight missing or of another
    shape, or (``complete``: ``expected`` is the whole model) a stored weight the model lacks.
    ``prefix``: where the model's weights sit among the stored names. Decided from metadata,
    before any tensor is read."""
    problems = []
    for key, shape in expected.items():
        size = getattr(stored.get(prefix + key), "size", None)
        if size is None:
            problems.append(f"{key} is missing there")
        elif tuple(size) != tuple(shape):
            problems.append(f"{key} is {tuple(size)} there, {tuple(shape)} in this model")
    if complete:
        problems += [
            f"{name.removeprefix(prefix)} is there but not in this model"
            for name, meta in stored.items()
            if name.startswith(prefix)
            and hasattr(meta, "size")
            and name.removeprefix(prefix) not in expected
        ]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(
            f"the weights in {source} are not this model's: {problems[0]}{more}; pass the job "
            "config (and any --section.key overrides) they were saved with"
        )


def _hf_tied_embeddings(folder: str) -> bool:
    return bool(read_hf_config(folder).get("tie_word_embeddings", False))


def load_hf_weights(model: LongContextModel, args: ModelArgs, folder: str) -> None:
    """Fill ``model`` (sharded or not) with the safetensors weights of a Hugging Face folder.

    Checkpoints with tied embeddings (Llama 3.2 1B/3B) have no ``lm_head.weight``: the output
    layer starts as a copy of the embeddings and is trained on its own from there.
    """
    family = family_of(args)
    adapter = family.state_dict_adapter(args, None)  # the folder matters for a save's layout only
    tied = _hf_tied_embeddings(folder)
    options = StateDictOptions(strict=False)
    check_safetensors(folder)
    stored = HuggingFaceStorageReader(folder).read_metadata().state_dict_metadata
    for group in _by_block(get_model_state_dict(model)):
        hf_group = adapter.to_hf(_by_columns(group, family.hf_rope_permuted))
        if tied:
            hf_group.pop("lm_head.weight", None)
        expected = {key: value.shape for key, value in hf_group.items()}
        check_shapes(expected, stored, folder, complete=False)
        dcp.load(hf_group, storage_reader=HuggingFaceStorageReader(folder))
        loaded = adapter.from_hf(hf_group)
        if tied and model.OUTPUT_WEIGHT in group:
            loaded[model.OUTPUT_WEIGHT] = loaded["tok_embeddings.weight"]
        set_model_state_dict(model, _like(loaded, group), options=options)


def load_dcp_weights(model: nn.Module, folder: str) -> None:
    """Fill ``model`` from a DCP checkpoint: one of our training snapshots (the model part only)
    or a model-only checkpoint with plain weight names (``convert --to dcp``, torchtitan's)."""
    keys = FileSystemReader(folder).read_metadata().state_dict_metadata
    state = get_model_state_dict(model)
    snapshot = any(key.startswith(SNAPSHOT_MODEL_PREFIX) for key in keys)
    expected = {key: value.shape for key, value in state.items()}
    check_shapes(expected, keys, folder, prefix=SNAPSHOT_MODEL_PREFIX if snapshot else "")
    if snapshot:
        dcp.load({"train": {"model": state}}, checkpoint_id=folder)
    else:
        dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state)


def save_dcp_weights(model: nn.Module, folder: str, *, overwrite: bool = False) -> list[str]:
    """A model-only DCP checkpoint with plain weight names (loadable by ``load_dcp_weights``),
    written and published as ``save_hf_weights`` writes its folder; returns the entries kept."""
    final = Path(folder)
    partial = temporary_sibling(final, _shared_token())
    try:
        dcp.save(get_model_state_dict(model), checkpoint_id=str(partial))
        return _on_rank0(lambda: publish_folder(partial, final, overwrite=overwrite))
    finally:
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)  # ours, left only by a failure


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _on_rank0(fn: Callable[[], T]) -> T:
    """``fn`` on rank 0, its result or error on every rank (just ``fn`` without a process group)."""
    return on_rank0(fn) if dist.is_initialized() else fn()


def _shared_token() -> str:
    """A random name every rank agrees on (rank 0's), for a folder they write together."""
    token = uuid.uuid4().hex[:12]
    return broadcast(token) if dist.is_initialized() else token


def save_hf_weights(
    model: nn.Module,
    args: ModelArgs,
    folder: str,
    *,
    dtype: torch.dtype,
    base_folder: str = "",
    tokenizer_folder: str = "",
    overwrite: bool = False,
) -> list[str]:
    """Write ``model`` as a Hugging Face folder ``transformers`` loads: config.json for ``args``
    (over ``base_folder``'s, keeping its other fields), safetensors in ``dtype`` (laid out in
    files as ``base_folder``'s index says, else one file), and the tokenizer files.

    Every rank writes its own shards; the shards are then merged into the final files (by one
    rank per file), as torchtitan's checkpointer does. The folder appears complete or not at all:
    it is written as a temporary sibling and moved into place at the end (``outputs``). A
    non-empty ``folder`` is refused (ConfigError) unless ``overwrite``, and even then only the
    files written here replace their namesakes; returns the names of the entries kept.
    """
    final = Path(folder)
    partial = temporary_sibling(final, _shared_token())
    try:
        _write_hf_folder(model, args, partial, dtype, base_folder, tokenizer_folder)
        return _on_rank0(lambda: publish_folder(partial, final, overwrite=overwrite))
    finally:
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)  # ours, left only by a failure


def hf_export_note(model: nn.Module, args: ModelArgs) -> str:
    """What the Hugging Face export of ``model`` leaves out that changes its numbers, in words
    ("" if nothing does; ``ModelFamily.hf_export_note``)."""
    note = family_of(args).hf_export_note
    return note(model) if note is not None else ""


def _write_hf_folder(
    model: nn.Module,
    args: ModelArgs,
    partial: Path,
    dtype: torch.dtype,
    base_folder: str,
    tokenizer_folder: str,
) -> None:
    """The Hugging Face folder of ``save_hf_weights``, written whole into ``partial``."""
    has_index = bool(base_folder) and (Path(base_folder) / "model.safetensors.index.json").is_file()
    family = family_of(args)
    adapter = family.state_dict_adapter(args, base_folder if has_index else None)
    state = {key: value.to(dtype) for key, value in get_model_state_dict(model).items()}
    hf_state = adapter.to_hf(_by_columns(state, family.hf_rope_permuted))
    mapping = adapter.fqn_to_index_mapping
    if mapping:  # the base's file layout; weights it lacks (an untied lm_head) go in its last file
        last = max(mapping.values())
        mapping = {key: mapping.get(key, last) for key in hf_state}
        sharded = partial / "sharded"
        dcp.save(
            hf_state,
            storage_writer=HuggingFaceStorageWriter(
                path=str(sharded),
                save_distributed=True,
                fqn_to_index_mapping=mapping,
            ),
        )
        consolidate_safetensors_files_on_every_rank(
            input_dir=str(sharded), output_dir=str(partial), fqn_to_index_mapping=mapping
        )
    else:
        dcp.save(
            hf_state,
            storage_writer=HuggingFaceStorageWriter(
                path=str(partial),
                save_distributed=True,
                enable_consolidation=True,
            ),
        )
    _barrier()
    if _rank() == 0:
        shutil.rmtree(partial / "sharded", ignore_errors=True)
        base = read_hf_config(base_folder) if base_folder else None
        config = hf_config_for(args, base)
        config.pop("dtype", None)  # transformers 5's name; both versions read torch_dtype
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for source in (base_folder, tokenizer_folder):
            source_dir = Path(source) if Path(source).is_dir() else Path(source).parent
            for name in HF_SIDE_FILES:
                if source and (source_dir / name).is_file() and not (partial / name).exists():
                    shutil.copy(source_dir / name, partial / name)
    _barrier()
