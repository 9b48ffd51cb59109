"""Hugging Face ``config.json`` <-> a model family's args, and the model shape a job asks for.

``[model] flavor = "hf"`` takes the whole shape from ``{hf_assets_path}/config.json`` (a
checkpoint of the family ``[model] name`` selects: Llama 3.x 1B to 70B, dense Qwen3, or a tiny
test model; each family parses its own fields, ``models.family``). A named flavor with an
``hf_assets_path`` must agree with that file field by field, so a mismatched checkpoint is caught
before any weight is read. ``[model] rope_*`` keys override the RoPE settings of either, which is
how a context-extension run raises the RoPE base or scaling of a pretrained model.

Both spellings of the RoPE fields are read: ``rope_theta`` + ``rope_scaling`` (Meta's files,
transformers 4) and ``rope_parameters`` (transformers 5). Exported files use the first, which
both transformers versions and vLLM read.

``check_safetensors`` names a damaged ``*.safetensors`` file of a folder from the headers alone:
the config's checks (the initial weights), the loaders and ``convert`` all ask it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from upipe_dtensor.models.family import family_of, family_of_hf_config, get_family
from upipe_dtensor.models.hf_fields import NO_SCALING, read_hf_config

__all__ = [
    "HF_FLAVOR",
    "args_from_hf",
    "hf_config_for",
    "hf_shape_mismatch",
    "model_args",
    "read_hf_config",
    "shape_fields",
]

HF_FLAVOR = "hf"
"""``[model] flavor`` value that reads the shape from ``hf_assets_path/config.json``."""

ModelArgs = Any
"""A registered family's args (``ModelFamily.args_class``)."""


def args_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """The args of a Hugging Face ``config.json``, parsed by the family of its ``model_type``
    (``source`` names the file in errors)."""
    return family_of_hf_config(config, source).args_from_hf(config, source)


def shape_fields(args: ModelArgs) -> dict[str, Any]:
    """The settings that change a model's numbers, by their config.json names: what a checkpoint
    and a flavor must agree on, and what a snapshot records (``checkpointing.model_record``)."""
    scaling = args.rope_scaling_args
    if scaling.scaling_factor == 1:  # no scaling, whatever the other factors say
        scaling = NO_SCALING
    extra = family_of(args).hf_extra_fields
    return (extra(args) if extra else {}) | {
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": args.resolved_head_dim,
        "intermediate_size": args.resolved_ffn_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": float(args.rope_theta),
        "rope_scaling.factor": scaling.scaling_factor,
        "rope_scaling.low_freq_factor": scaling.low_freq_factor,
        "rope_scaling.high_freq_factor": scaling.high_freq_factor,
        "rope_scaling.original_max_position_embeddings": scaling.original_max_position_embeddings,
    }


def _rope_overrides(model_config) -> dict[str, Any]:
    """The [model] rope_* keys the job sets (0 means 'keep the flavor's / config.json's')."""
    fields = {
        "rope_theta": model_config.rope_theta,
        "scaling_factor": model_config.rope_scaling_factor,
        "low_freq_factor": model_config.rope_low_freq_factor,
        "high_freq_factor": model_config.rope_high_freq_factor,
        "original_max_position_embeddings": model_config.rope_original_max_position_embeddings,
    }
    return {key: value for key, value in fields.items() if value}


def model_args(model_config, seq_len: int) -> ModelArgs:
    """The model a job's ``[model]`` section describes, for ``seq_len``-token sequences.

    ``model_config`` is a ``config.Model``. Raises ValueError naming the key and a fix.
    """
    flavor, hf_path = model_config.flavor, model_config.hf_assets_path
    family = get_family(model_config.name)
    overrides = _rope_overrides(model_config)
    if flavor == HF_FLAVOR:
        if not hf_path:
            raise ValueError(
                "[model] flavor = 'hf' takes the shape from config.json; set [model] "
                "hf_assets_path to the Hugging Face model folder"
            )
        args = _family_args(family.name, read_hf_config(hf_path), f"{hf_path}/config.json")
    elif flavor in family.flavors:
        args = family.flavors[flavor]
        if hf_path:
            _check_flavor(flavor, args, hf_path, overrides)
    else:
        raise ValueError(
            f"[model] flavor = {flavor!r} is unknown for {family.name}; choose one of "
            f"{sorted(family.flavors)} or '{HF_FLAVOR}' (shape from hf_assets_path/config.json)"
        )
    if model_config.moe_force_load_balance:
        if not family.mixture_of_experts:
            raise ValueError(
                f"[model] moe_force_load_balance = true: {family.name} has no experts; "
                "set it to false"
            )
        args = dataclasses.replace(args, force_load_balance=True)
    theta = overrides.pop("rope_theta", args.rope_theta)
    scaling = dataclasses.replace(args.rope_scaling_args, **overrides)
    if scaling.scaling_factor != 1 and not scaling.low_freq_factor < scaling.high_freq_factor:
        raise ValueError(
            f"[model] RoPE scaling needs rope_low_freq_factor < rope_high_freq_factor, got "
            f"{scaling.low_freq_factor} and {scaling.high_freq_factor}"
        )
    return dataclasses.replace(
        args, rope_theta=theta, rope_scaling_args=scaling, max_seq_len=seq_len
    )


def _family_args(name: str, config: dict[str, Any], source: str) -> ModelArgs:
    """The args of a config.json that must be of the family ``[model] name`` names."""
    family = family_of_hf_config(config, source)
    if family.name != name:
        raise ValueError(
            f"{source} is a {family.name} model (model_type {family.hf_model_type!r}), but "
            f"[model] name = {name!r}; set [model] name = {family.name!r}"
        )
    return family.args_from_hf(config, source)


def _check_flavor(flavor: str, args: ModelArgs, hf_path: str, overrides: dict[str, Any]) -> None:
    """A named flavor must describe the checkpoint it loads (RoPE keys the job overrides aside)."""
    source = f"{hf_path}/config.json"
    found_args = _family_args(family_of(args).name, read_hf_config(hf_path), source)
    expected, found = shape_fields(args), shape_fields(found_args)
    for key, value in expected.items():
        if key.removeprefix("rope_scaling.") in overrides:
            continue
        if found[key] != value:
            raise ValueError(
                f"[model] flavor = {flavor!r} has {key} = {value}, but {source} has {found[key]}; "
                f"set flavor = '{HF_FLAVOR}' to take the shape from config.json, or point "
                f"hf_assets_path at a {flavor} checkpoint"
            )


def hf_shape_mismatch(args: ModelArgs, config: dict[str, Any]) -> str:
    """The first weight-shape field (RoPE aside) on which ``args`` and a config.json differ, as
    'field = ours vs theirs', or "" when the checkpoint's weights fit ``args``."""
    other = args_from_hf(config, "config.json")
    if family_of(other) is not family_of(args):
        return f"model_type = {family_of(args).hf_model_type} (model) vs {config['model_type']}"
    ours, theirs = shape_fields(args), shape_fields(other)
    for key, value in ours.items():
        if not key.startswith("rope_") and theirs[key] != value:
            return f"{key} = {value} (model) vs {theirs[key]} (checkpoint)"
    return ""


def hf_config_for(args: ModelArgs, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` for ``args``: ``base`` (the source checkpoint's, to keep its token ids
    and other fields) with the shape and RoPE of ``args`` written over it. Embeddings are untied:
    the trained model has its own output layer. ``max_position_embeddings`` is the longest of the
    source's, the training length and the length the RoPE scaling stretches to (original x
    factor): transformers requires it above ``original_max_position_embeddings`` (it warns on
    load otherwise), and a model trained on 512 tokens with Llama 3.1's scaling keeps that
    scaling's reach."""
    scaling, family = args.rope_scaling_args, family_of(args)
    config = dict(base or {})
    config.pop("rope_parameters", None)  # replaced by rope_theta + rope_scaling below
    config.update(
        {
            "architectures": [family.hf_architecture],
            "model_type": family.hf_model_type,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            **{
                key: value
                for key, value in shape_fields(args).items()
                if not key.startswith("rope_scaling.")
            },
            "rope_scaling": None
            if scaling.scaling_factor == 1
            else {
                "rope_type": "llama3",
                "factor": scaling.scaling_factor,
                "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_position_embeddings,
            },
        }
    )
    config["max_position_embeddings"] = max(
        config.get("max_position_embeddings", 0),
        args.max_seq_len,
        int(scaling.original_max_position_embeddings * scaling.scaling_factor),
    )
    return config


def check_safetensors(folder: str) -> None:
    """ValueError naming the first damaged ``*.safetensors`` file of ``folder``, found from the
    headers alone (a few KiB per file): a truncated copy or download is named here instead of
    surfacing as a reader error without a file name while the model loads."""
    for path in sorted(Path(folder).glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem:
            raise ValueError(f"{path} {problem}; copy or download it again")


def _safetensors_problem(path: Path) -> str:
    """What is wrong with one safetensors file ("" if its header parses and its tensors fit in
    it). The format: 8 bytes of header length, a JSON header, then the tensors' bytes."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        if size < 8 or 8 + length > size:
            return f"is truncated: {size:,} bytes, fewer than its header alone needs"
        try:
            header = json.loads(handle.read(length))
            tensors = (entry for key, entry in header.items() if key != "__metadata__")
            end = max((int(entry["data_offsets"][1]) for entry in tensors), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "is damaged: its header is not a safetensors header"
    if 8 + length + end > size:
        return f"is truncated: {size:,} bytes, its header describes {8 + length + end:,}"
    return ""
