"""upipe-dtensor: UPipe (headwise-chunked Ulysses) context parallelism for PyTorch-native
training."""

import upipe_dtensor.models  # noqa: F401  (registers the model families' attention modules)
from upipe_dtensor.parallel import (
    ContextParallelAttention,
    FPDTAttention,
    RingAttention,
    UlyssesAttention,
    UPipeAttention,
)

__all__ = [
    "ContextParallelAttention",
    "UPipeAttention",
    "UlyssesAttention",
    "RingAttention",
    "FPDTAttention",
]
