"""Model families on torchtitan's models (``family``: the registry), and what they share for
long contexts (``long_context``): Llama3 (debug, 8B, the paper's 32B shape) and dense Qwen3, on
the installed torchtitan generation (``generation``: 0.2.2's ``tt022`` or 0.3.0's ``tt030``)."""

from upipe_dtensor.models.family import FAMILIES, ModelFamily, family_of, get_family
from upipe_dtensor.models.generation import family_module
from upipe_dtensor.models.long_context import (
    IGNORE_INDEX,
    ForwardPlan,
    LongContextModel,
    flops_per_token,
    init_sharded_weights,
)

_llama3, _qwen3 = family_module("llama3"), family_module("qwen3")
FLAVORS, Llama3, Llama3Args, build_llama3 = (
    _llama3.FLAVORS,
    _llama3.Llama3,
    _llama3.Llama3Args,
    _llama3.build_llama3,
)
Qwen3, Qwen3Args = _qwen3.Qwen3, _qwen3.Qwen3Args

__all__ = [
    "FAMILIES",
    "FLAVORS",
    "ForwardPlan",
    "IGNORE_INDEX",
    "Llama3",
    "Llama3Args",
    "LongContextModel",
    "ModelFamily",
    "Qwen3",
    "Qwen3Args",
    "build_llama3",
    "family_of",
    "flops_per_token",
    "get_family",
    "init_sharded_weights",
]
