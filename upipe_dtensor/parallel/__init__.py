"""Context-parallel attention: layouts, the all-to-all, the ring, the UPipe and FPDT ops, and the
ParallelStyles."""

from upipe_dtensor.parallel.style import (
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
