"""The model-family registry: what a job, the CP styles, the memory stack and the HF weights
need to know of each family, in one entry per family (torchtitan's ``TrainSpec`` plays this
part there).

``[model] name`` selects the entry. Adding a family is one module per torchtitan generation
(``models.tt022``, ``models.tt030``: its args, flavors and model class on that generation's
model, with the same names in each) plus one ``register_family`` call below; the installed
generation's modules are the ones registered (``models.generation``). See docs/design.md,
"Adding a model family".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from torch import nn

from upipe_dtensor.memory.tiled_mlp import register_swiglu_mlp
from upipe_dtensor.memory.tiled_moe import register_moe
from upipe_dtensor.models.generation import TORCHTITAN_VERSION, family_module
from upipe_dtensor.models.long_context import LongContextModel
from upipe_dtensor.parallel.attention_interface import (
    AttentionAdapter,
    register_attention_adapter,
)


@dataclass(frozen=True)
class ModelFamily:
    """One model family."""

    name: str
    """``[model] name``."""
    args_class: type
    """Its model args (torchtitan's, with ``resolved_head_dim``, ``resolved_ffn_dim`` and
    ``rope_scaling_args``)."""
    flavors: Mapping[str, Any]
    """``[model] flavor`` -> args."""
    model_class: type[LongContextModel]
    attention_class: type[nn.Module]
    """torchtitan's attention module of the family, which the CP styles replace."""
    attention_adapter: AttentionAdapter
    """How the CP styles read that module (``parallel.attention_interface``)."""
    mlp_class: type[nn.Module]
    """torchtitan's bias-free SwiGLU MLP of the family, or its MoE block for a mixture of
    experts (what ``memory.tiled_mlp`` tiles)."""
    hf_model_type: str
    """config.json's ``model_type``."""
    args_from_hf: Callable[[dict[str, Any], str], Any]
    """``(config.json as a dict, its name for messages) -> args``; ValueError naming a field
    the family's model does not implement."""
    hf_architecture: str
    """config.json's ``architectures`` entry of an exported folder."""
    state_dict_adapter: Callable[[Any, str | None], Any]
    """``(args, hf_assets_path) ->`` torchtitan's state-dict adapter between its names and
    Hugging Face's."""
    hf_rope_permuted: tuple[str, ...] = ()
    """Weight names whose rows Hugging Face stores permuted for its RoPE pairing (Llama3's wq,
    wk: torchtitan rotates interleaved pairs, HF the halves); the adapter permutes them."""
    mixture_of_experts: bool = False
    """Its blocks' MLPs are torchtitan's ``MoE`` (router, grouped experts), not a SwiGLU MLP."""
    expert_parallel: Callable[[nn.Module, Any], list[nn.Module]] | None = None
    """``(model, (efsdp, ep) mesh) ->`` its experts split over ``ep``, the grouped-experts
    modules returned for FSDP2 over ``efsdp`` (a mixture of experts only)."""
    balanced_routing: Callable[[float], AbstractContextManager] | None = None
    """``load ->`` a context in which expert parallelism's exchanges are sized for evenly spread
    routing (``load`` > 1: this rank's experts receive that many times their share), which the
    planner's fake step assumes (fake tensors hold no routing to read)."""
    hf_export_note: Callable[[nn.Module], str] | None = None
    """``model ->`` what its Hugging Face export leaves out that changes its numbers, in words
    ("" if nothing does): said beside the export."""
    hf_extra_fields: Callable[[Any], dict[str, Any]] | None = None
    """``args ->`` the config.json fields of the family's shape beyond the dense decoder's
    (``models.hf_config.shape_fields``), such as a mixture of experts' counts."""


FAMILIES: dict[str, ModelFamily] = {}
UNAVAILABLE: dict[str, str] = {}
"""Families the installed torchtitan generation lacks -> the line that says what to install."""


def register_family(family: ModelFamily) -> None:
    """Register ``family`` for ``[model] name``, its attention module for the CP styles and its
    MLP for the tiled MLP."""
    FAMILIES[family.name] = family
    register_attention_adapter(family.attention_class, family.attention_adapter)
    if family.mixture_of_experts:
        register_moe(family.mlp_class)
    else:
        register_swiglu_mlp(family.mlp_class)


def get_family(name: str) -> ModelFamily:
    """The family ``[model] name`` selects; ValueError naming the registered ones."""
    if name in UNAVAILABLE:
        raise ValueError(f"[model] name = {name!r}: {UNAVAILABLE[name]}")
    if name not in FAMILIES:
        raise ValueError(
            f"[model] name = {name!r} is not a registered model family; choose one of "
            f"{sorted(FAMILIES)}"
        )
    return FAMILIES[name]


def family_of(args: Any) -> ModelFamily:
    """The family whose args class ``args`` is (exactly: one family's args may subclass
    another's, as Qwen3-MoE's do Qwen3's)."""
    for family in FAMILIES.values():
        if type(args) is family.args_class:
            return family
    raise ValueError(f"{type(args).__name__} is not the args class of a registered model family")


def family_of_hf_config(config: dict[str, Any], source: str) -> ModelFamily:
    """The family of a Hugging Face ``config.json`` by its ``model_type``."""
    model_type = config.get("model_type")
    for family in FAMILIES.values():
        if family.hf_model_type == model_type:
            return family
    types = sorted(f.hf_model_type for f in FAMILIES.values())
    raise ValueError(
        f"{source}: model_type = {model_type!r}; the registered model families load {types}"
    )


def _register(name: str, hf_model_type: str, hf_architecture: str) -> None:
    """Register the installed torchtitan generation's module of family ``name``; a family
    that generation lacks is named in ``UNAVAILABLE`` instead."""
    try:
        module = family_module(name)
    except ModuleNotFoundError as missing:
        if not (missing.name or "").startswith("upipe_dtensor.models."):
            raise
        UNAVAILABLE[name] = (
            f"the {name} family runs on torchtitan 0.3.0 (with torch >= 2.13), and torchtitan "
            f"{TORCHTITAN_VERSION} is installed: pip install torch==2.13.0 torchtitan==0.3.0"
        )
        return
    register_family(
        ModelFamily(
            name=name,
            args_class=module.ARGS_CLASS,
            flavors=module.FLAVORS,
            model_class=module.MODEL_CLASS,
            attention_class=module.ATTENTION_CLASS,
            attention_adapter=module.ATTENTION_ADAPTER,
            mlp_class=module.MLP_CLASS,
            hf_model_type=hf_model_type,
            args_from_hf=module.args_from_hf,
            hf_architecture=hf_architecture,
            state_dict_adapter=module.hf_adapter,
            hf_rope_permuted=module.HF_ROPE_PERMUTED,
            mixture_of_experts=getattr(module, "MIXTURE_OF_EXPERTS", False),
            expert_parallel=getattr(module, "EXPERT_PARALLEL", None),
            balanced_routing=getattr(module, "BALANCED_ROUTING", None),
            hf_extra_fields=getattr(module, "hf_extra_fields", None),
            hf_export_note=getattr(module, "hf_export_note", None),
        )
    )


_register("llama3", hf_model_type="llama", hf_architecture="LlamaForCausalLM")
_register("qwen3", hf_model_type="qwen3", hf_architecture="Qwen3ForCausalLM")
_register("qwen3_moe", hf_model_type="qwen3_moe", hf_architecture="Qwen3MoeForCausalLM")
