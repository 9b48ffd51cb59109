"""Context-parallel attention: layouts, the all-to-all, the ring, the UPipe and FPDT ops, and the ParallelStyles."""

from .style import FPDTAttention, RingAttention, UlyssesAttention, UPipeAttention

__all__ = ["UPipeAttention", "UlyssesAttention", "RingAttention", "FPDTAttention"]
