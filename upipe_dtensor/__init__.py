"""upipe-dtensor: UPipe (headwise-chunked Ulysses) context parallelism for PyTorch-native
training.

The CP styles are exported here; the sub-packages, lowest layer first (a layer imports only its
own and lower ones, ``tests/test_layering.py``): ``errors`` (the shared exceptions), ``runtime``,
``kernels``, ``memory``, ``parallel``, ``models``, ``config``, ``checkpointing``, ``data``, the
training job in ``train`` (setup, build, parallelize, trainer), ``planning``, then the GPU
verification tools in ``verify`` (gpu_check, stand_in, kernel_rates, evidence) and the user
commands in ``commands`` (evaluate, retrieval, convert; their ``python -m`` names are the modules
here), and ``integrations`` (torchtitan's own trainer running the styles). Every module file is
listed in docs/design.md, "Layout". Without torchtitan installed the styles still import (for a
model whose attention has an adapter registered, ``parallel.attention_interface``); the model
families, the trainer and the planner need it.
"""

try:  # the model families (torchtitan's Llama3 and Qwen3) register their attention adapters
    import upipe_dtensor.models  # noqa: F401
except ModuleNotFoundError as err:  # the styles apply to any model with an adapter
    if (err.name or "").split(".")[0] != "torchtitan":
        raise
from upipe_dtensor.parallel import (
    ContextParallelAttention,
    FPDTAttention,
    RingAttention,
    UlyssesAttention,
    UPipeAttention,
    UPipeFPDTAttention,
)

__all__ = [
    "ContextParallelAttention",
    "UPipeAttention",
    "UPipeFPDTAttention",
    "UlyssesAttention",
    "RingAttention",
    "FPDTAttention",
]
