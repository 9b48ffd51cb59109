"""Reading Hugging Face ``config.json`` fields that every model family's parser shares."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from upipe_dtensor.models.generation import generation_module

RoPEScalingArgs = generation_module().RoPEScalingArgs
"""Llama3's RoPE scaling as the installed torchtitan generation's families hold it."""

NO_SCALING = RoPEScalingArgs(scaling_factor=1.0)
"""Llama3 scaling with factor 1 leaves every frequency unchanged (Llama 3.0, Qwen3, most test
models)."""


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


def rope_from_hf(config: dict[str, Any], source: str) -> tuple[float, RoPEScalingArgs]:
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


_EXPERTS = (
    "mixture of experts (model_type 'qwen3_moe', which [model] name = 'qwen3_moe' reads; "
    "qwen2_moe, mixtral and deepseek_v3 are not implemented)"
)
_LATENT = "multi-head latent attention (model_type deepseek_v3)"
UNREAD_FIELDS: dict[str, str] = {
    "num_experts": _EXPERTS,  # as the Qwen-MoE checkpoints publish it
    "num_local_experts": _EXPERTS,  # as transformers 5 writes every MoE config
    "n_routed_experts": _EXPERTS,
    "num_experts_per_tok": _EXPERTS,
    "moe_intermediate_size": _EXPERTS,
    "q_lora_rank": _LATENT,
    "kv_lora_rank": _LATENT,
}
"""config.json fields that the dense families do not read, and the Hugging Face model types that do.
Each changes the model's numbers, so a config carrying one (say a Qwen3-MoE ``config.json``
relabelled ``model_type = "qwen3"``) would otherwise load silently as a dense model with its
experts or latent projections dropped. A field present but empty (0, null, []) means off."""


def check_supported(
    config: dict[str, Any], supported: dict[str, Any], source: str, reads: tuple[str, ...] = ()
) -> None:
    """ValueError for a config.json field whose value the family's model does not implement:
    one of ``supported``'s with another value, one of ``UNREAD_FIELDS`` set that the family
    does not read (``reads``), or a layer kind other than full attention in ``layer_types``
    (transformers' per-layer sliding windows)."""
    for key, readers in UNREAD_FIELDS.items():
        if config.get(key) and key not in reads:
            raise ValueError(
                f"{source}: {key} = {config[key]!r} configures {readers}; loading it as "
                f"model_type {config.get('model_type')!r} would drop it"
            )
    other_layers = sorted(set(config.get("layer_types") or ()) - {"full_attention"})
    if other_layers:
        raise ValueError(
            f"{source}: layer_types has {other_layers}; only full attention in every layer is "
            f"implemented: use a checkpoint without sliding-window layers"
        )
    for key, value in supported.items():
        if config.get(key, value) != value:
            raise ValueError(f"{source}: {key} = {config[key]!r} is not supported (only {value!r})")


def require(config: dict[str, Any], keys: tuple[str, ...], source: str, family: str) -> None:
    """ValueError naming the fields a family's config.json must have and lacks."""
    missing = [k for k in keys if k not in config]
    if missing:
        raise ValueError(f"{source}: missing {missing}; is this a {family} config.json?")
