"""Context-parallel attention: the all-to-all, the UPipe stage loop and the ParallelStyles."""

from .style import UlyssesAttention, UPipeAttention

__all__ = ["UPipeAttention", "UlyssesAttention"]
