"""upipe-dtensor: UPipe (headwise-chunked Ulysses) context parallelism for PyTorch-native training."""

from .parallel import UlyssesAttention, UPipeAttention

__all__ = ["UPipeAttention", "UlyssesAttention"]
