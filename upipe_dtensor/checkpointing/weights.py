"""Model weights in and out: Hugging Face safetensors folders and model-only DCP checkpoints.

Everything goes through torch.distributed.checkpoint (DCP), so a sharded model reads and writes
only its own shards: DCP plans, for each rank, the slices of each stored tensor that overlap the
rank's DTensor shards, and the Hugging Face reader reads just those slices from the safetensors
files. No rank ever holds the whole model. The names and the RoPE permutation between torchtitan's
layout and Hugging Face's are torchtitan's ``Llama3StateDictAdapter`` (see ``Llama3HFAdapter``).

The same functions work on plain (unsharded) tensors, which is what ``convert`` uses.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import (
    FileSystemReader,
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files_on_every_rank,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, Shard
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

from upipe_dtensor.models.hf_config import hf_config_for, hf_shape_mismatch, read_hf_config
from upipe_dtensor.models.llama3 import Llama3Args

SNAPSHOT_MODEL_PREFIX = "train.model."
"""Where a training snapshot (``checkpoint.Checkpointer``) keeps the model's weights."""

HF_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
"""Files copied next to exported weights, so the folder is a complete Hugging Face model."""


class Llama3HFAdapter(Llama3StateDictAdapter):
    """torchtitan's Llama3 <-> Hugging Face key map and RoPE permutation, for any head_dim.

    torchtitan 0.2.2 sizes wk's permutation with head_dim = dim // n_heads, which is wrong when
    n_heads * head_dim != dim (the 32B flavor; checkpoints with an explicit head_dim). The
    permutation needs only the head count: every other size is the weight's own shape, which is
    what torchtitan's ``_permute`` uses when no sizes are passed (as it does for wq).
    """

    def _permute(self, w, n_heads_arg, dim1=None, dim2=None):
        return super()._permute(w, n_heads_arg)

    def _reverse_permute(self, w, n_heads_arg, dim1=None, dim2=None):
        return super()._reverse_permute(w, n_heads_arg)


_ROPE_PERMUTED = ("attention.wq.weight", "attention.wk.weight")


def _by_columns(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with wq and wk re-sharded by columns (input features).

    The adapter's RoPE permutation reorders rows within each head. FSDP2 shards rows, and when a
    rank's rows do not hold whole heads (8 KV heads on 16 ranks) DTensor cannot reorder them in
    place. Sharded by columns, every rank holds all rows of its columns: the permutation is local,
    and each rank still reads and writes only its 1/world of the weight. The re-sharding is an
    all-to-all on NCCL; gloo has none, and DTensor falls back to an all-gather there (one block's
    wq or wk whole on each CPU rank, briefly).
    """
    resharded = dict(state)
    for key, value in state.items():
        if key.endswith(_ROPE_PERMUTED) and isinstance(value, DTensor):
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


def initial_load_folder(config) -> str:
    """The folder [checkpoint] initial_load_path names (hf_assets_path for an HF load without
    one), or "" when the job starts from the seed's initial weights."""
    checkpoint = config.checkpoint
    if checkpoint.initial_load_in_hf:
        return checkpoint.initial_load_path or config.model.hf_assets_path
    return checkpoint.initial_load_path


def check_initial_load(config, args: Llama3Args) -> None:
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
    mismatch = hf_shape_mismatch(args, read_hf_config(folder))
    if mismatch:
        raise ValueError(
            f"the model to train and the weights in {folder}/config.json differ: {mismatch}"
        )


def _hf_tied_embeddings(folder: str) -> bool:
    return bool(read_hf_config(folder).get("tie_word_embeddings", False))


def load_hf_weights(model: nn.Module, args: Llama3Args, folder: str) -> None:
    """Fill ``model`` (sharded or not) with the safetensors weights of a Hugging Face folder.

    Checkpoints with tied embeddings (Llama 3.2 1B/3B) have no ``lm_head.weight``: the output
    layer starts as a copy of the embeddings and is trained on its own from there.
    """
    adapter = Llama3HFAdapter(args, None)  # the folder only matters for a save's file layout
    tied = _hf_tied_embeddings(folder)
    options = StateDictOptions(strict=False)
    for group in _by_block(get_model_state_dict(model)):
        hf_group = adapter.to_hf(_by_columns(group))
        if tied:
            hf_group.pop("lm_head.weight", None)
        dcp.load(hf_group, storage_reader=HuggingFaceStorageReader(folder))
        loaded = adapter.from_hf(hf_group)
        if tied and "output.weight" in group:
            loaded["output.weight"] = loaded["tok_embeddings.weight"]
        set_model_state_dict(model, _like(loaded, group), options=options)


def load_dcp_weights(model: nn.Module, folder: str) -> None:
    """Fill ``model`` from a DCP checkpoint: one of our training snapshots (the model part only)
    or a model-only checkpoint with plain weight names (``convert --to dcp``, torchtitan's)."""
    keys = FileSystemReader(folder).read_metadata().state_dict_metadata
    state = get_model_state_dict(model)
    if any(key.startswith(SNAPSHOT_MODEL_PREFIX) for key in keys):
        dcp.load({"train": {"model": state}}, checkpoint_id=folder)
    else:
        dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state)


def save_dcp_weights(model: nn.Module, folder: str) -> None:
    """A model-only DCP checkpoint with plain weight names (loadable by ``load_dcp_weights``)."""
    dcp.save(get_model_state_dict(model), checkpoint_id=folder)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_hf_weights(
    model: nn.Module,
    args: Llama3Args,
    folder: str,
    *,
    dtype: torch.dtype,
    base_folder: str = "",
    tokenizer_folder: str = "",
) -> None:
    """Write ``model`` as a Hugging Face folder ``transformers`` loads: config.json for ``args``
    (over ``base_folder``'s, keeping its other fields), safetensors in ``dtype`` (laid out in
    files as ``base_folder``'s index says, else one file), and the tokenizer files.

    Every rank writes its own shards; the shards are then merged into the final files (by one
    rank per file), as torchtitan's checkpointer does. The folder appears complete or not at all:
    it is written as ``folder.partial`` and renamed at the end.
    """
    final, partial = Path(folder), Path(f"{folder}.partial")
    if _rank() == 0 and partial.exists():
        shutil.rmtree(partial)
    _barrier()
    has_index = bool(base_folder) and (Path(base_folder) / "model.safetensors.index.json").is_file()
    adapter = Llama3HFAdapter(args, base_folder if has_index else None)
    state = {key: value.to(dtype) for key, value in get_model_state_dict(model).items()}
    hf_state = adapter.to_hf(_by_columns(state))
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
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
    _barrier()
