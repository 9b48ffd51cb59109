"""Llama3 flavors on torchtitan's model: debug, 8B and the paper's 32B shape."""

from upipe_dtensor.models.llama3 import (
    FLAVORS,
    Llama3,
    Llama3Args,
    build_llama3,
    flops_per_token,
    init_sharded_weights,
)

__all__ = [
    "FLAVORS",
    "Llama3",
    "Llama3Args",
    "build_llama3",
    "flops_per_token",
    "init_sharded_weights",
]
