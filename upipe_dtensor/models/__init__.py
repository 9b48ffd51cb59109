"""Model families on torchtitan's models (``family``: the registry), and what they share for
long contexts (``long_context``): Llama3 (debug, 8B, the paper's 32B shape) and dense Qwen3."""

from upipe_dtensor.models.family import FAMILIES, ModelFamily, family_of, get_family
from upipe_dtensor.models.llama3 import FLAVORS, Llama3, Llama3Args, build_llama3
from upipe_dtensor.models.long_context import (
    IGNORE_INDEX,
    ForwardPlan,
    LongContextModel,
    flops_per_token,
    init_sharded_weights,
)
from upipe_dtensor.models.qwen3 import Qwen3, Qwen3Args

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
