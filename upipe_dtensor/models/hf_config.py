"""Hugging Face ``config.json`` <-> ``Llama3Args``, and the model shape a job asks for.

``[model] flavor = "hf"`` takes the whole shape from ``{hf_assets_path}/config.json`` (any
Llama-architecture checkpoint: Llama 3.x 1B to 70B, or a tiny test model). A named flavor with an
``hf_assets_path`` must agree with that file field by field, so a mismatched checkpoint is caught
before any weight is read. ``[model] rope_*`` keys override the RoPE settings of either, which is
how a context-extension run raises the RoPE base or scaling of a pretrained model.

Both spellings of the RoPE fields are read: ``rope_theta`` + ``rope_scaling`` (Meta's files,
transformers 4) and ``rope_parameters`` (transformers 5). Exported files use the first, which
both transformers versions and vLLM read.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from torchtitan.models.llama3.model.args import RoPEScalingArgs

from upipe_dtensor.models.llama3 import FLAVORS, Llama3Args

HF_FLAVOR = "hf"
"""``[model] flavor`` value that reads the shape from ``hf_assets_path/config.json``."""

NO_SCALING = RoPEScalingArgs(scaling_factor=1.0)
"""Llama3 scaling with factor 1 leaves every frequency unchanged (Llama 3.0, most test models)."""


def read_hf_config(hf_assets_path: str) -> dict[str, Any]:
    """The parsed ``config.json`` of a Hugging Face model folder; ValueError naming the fix."""
    path = Path(hf_assets_path) / "config.json"
    if not path.is_file():
        raise ValueError(
            f"[model] hf_assets_path = {hf_assets_path!r} has no config.json; point it at a "
            f"Hugging Face model folder (config.json, *.safetensors, tokenizer.json)"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err


def _rope_from_hf(config: dict[str, Any], source: str) -> tuple[float, RoPEScalingArgs]:
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or parameters
    theta = config.get("rope_theta", parameters.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), NO_SCALING
    if rope_type != "llama3":
        raise ValueError(
            f"{source}: rope_type = {rope_type!r} is not supported; only Llama3 RoPE scaling "
            f"('llama3') or none ('default') is"
        )
    return float(theta), RoPEScalingArgs(
        scaling_factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


_UNSUPPORTED = {  # config.json field: the only value our Llama3 implements
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
}


def args_from_hf(config: dict[str, Any], source: str) -> Llama3Args:
    """The ``Llama3Args`` of a Hugging Face Llama ``config.json`` (``source`` names it in
    errors)."""
    if config.get("model_type") != "llama":
        raise ValueError(
            f"{source}: model_type = {config.get('model_type')!r}; only Llama-architecture "
            f"checkpoints ('llama') can be loaded"
        )
    for key, supported in _UNSUPPORTED.items():
        if config.get(key, supported) != supported:
            raise ValueError(
                f"{source}: {key} = {config[key]!r} is not supported (only {supported!r})"
            )
    missing = [
        k
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        if k not in config
    ]
    if missing:
        raise ValueError(f"{source}: missing {missing}; is this a Llama config.json?")
    theta, scaling = _rope_from_hf(config, source)
    n_heads = config["num_attention_heads"]
    return Llama3Args(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
        ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling_args=scaling,
    )


def shape_fields(args: Llama3Args) -> dict[str, Any]:
    """The settings that change a model's numbers, by their config.json names: what a checkpoint
    and a flavor must agree on, and what a snapshot records (``checkpointing.model_record``)."""
    scaling = args.rope_scaling_args
    if scaling.scaling_factor == 1:  # no scaling, whatever the other factors say
        scaling = NO_SCALING
    return {
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


def model_args(model_config, seq_len: int) -> Llama3Args:
    """The model a job's ``[model]`` section describes, for ``seq_len``-token sequences.

    ``model_config`` is a ``config.Model``. Raises ValueError naming the key and a fix.
    """
    flavor, hf_path = model_config.flavor, model_config.hf_assets_path
    overrides = _rope_overrides(model_config)
    if flavor == HF_FLAVOR:
        if not hf_path:
            raise ValueError(
                "[model] flavor = 'hf' takes the shape from config.json; set [model] "
                "hf_assets_path to the Hugging Face model folder"
            )
        args = args_from_hf(read_hf_config(hf_path), f"{hf_path}/config.json")
    elif flavor in FLAVORS:
        args = FLAVORS[flavor]
        if hf_path:
            _check_flavor(flavor, args, hf_path, overrides)
    else:
        raise ValueError(
            f"[model] flavor = {flavor!r} is unknown; choose one of {sorted(FLAVORS)} or "
            f"'{HF_FLAVOR}' (shape from hf_assets_path/config.json)"
        )
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


def _check_flavor(flavor: str, args: Llama3Args, hf_path: str, overrides: dict[str, Any]) -> None:
    """A named flavor must describe the checkpoint it loads (RoPE keys the job overrides aside)."""
    source = f"{hf_path}/config.json"
    expected, found = (
        shape_fields(args),
        shape_fields(args_from_hf(read_hf_config(hf_path), source)),
    )
    for key, value in expected.items():
        if key.removeprefix("rope_scaling.") in overrides:
            continue
        if found[key] != value:
            raise ValueError(
                f"[model] flavor = {flavor!r} has {key} = {value}, but {source} has {found[key]}; "
                f"set flavor = '{HF_FLAVOR}' to take the shape from config.json, or point "
                f"hf_assets_path at a {flavor} checkpoint"
            )


def hf_shape_mismatch(args: Llama3Args, config: dict[str, Any]) -> str:
    """The first weight-shape field (RoPE aside) on which ``args`` and a config.json differ, as
    'field = ours vs theirs', or "" when the checkpoint's weights fit ``args``."""
    ours, theirs = shape_fields(args), shape_fields(args_from_hf(config, "config.json"))
    for key, value in ours.items():
        if not key.startswith("rope_") and theirs[key] != value:
            return f"{key} = {value} (model) vs {theirs[key]} (checkpoint)"
    return ""


def hf_config_for(args: Llama3Args, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` for ``args``: ``base`` (the source checkpoint's, to keep its token ids
    and other fields) with the shape and RoPE of ``args`` written over it. Embeddings are untied:
    the trained model has its own output layer."""
    scaling = args.rope_scaling_args
    config = dict(base or {})
    config.pop("rope_parameters", None)  # replaced by rope_theta + rope_scaling below
    config.update(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
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
        config.get("max_position_embeddings", 0), args.max_seq_len
    )
    return config
