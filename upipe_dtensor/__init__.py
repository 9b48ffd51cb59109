"""upipe-dtensor: UPipe (headwise-chunked Ulysses) context parallelism for PyTorch-native training."""

from .parallel import FPDTAttention, RingAttention, UlyssesAttention, UPipeAttention

__all__ = ["UPipeAttention", "UlyssesAttention", "RingAttention", "FPDTAttention"]
