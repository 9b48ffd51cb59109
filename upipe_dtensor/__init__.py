"""upipe-dtensor: UPipe (headwise-chunked Ulysses) context parallelism for PyTorch-native
training."""

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
