"""upipe-dtensor: UPipe (headwise-chunked Ulysses) context parallelism for PyTorch-native
training.

The CP styles are exported here; the sub-packages, lowest layer first (a layer imports only its
own and lower ones, ``tests/test_layering.py``): ``errors`` (the shared exceptions), ``runtime``,
``kernels``, ``memory``, ``parallel``, ``models``, ``checkpointing``, ``config``, ``data``, the
job assembly in ``jobs`` (setup, build, parallelize, trainer), ``planning``, then the commands
(``jobs``' evaluate, retrieval, convert, gpu_check, and the ``python -m`` modules here), and
``integrations`` (torchtitan's own trainer running the styles). Every
module file is listed in docs/design.md, "Layout".
"""

import upipe_dtensor.models  # noqa: F401  (registers the model families' attention modules)
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
