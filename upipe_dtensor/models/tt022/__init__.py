"""The model families on torchtitan 0.2.2 (``llama3``, ``qwen3``), and what they share here.

0.2.2's models are built from model-args dataclasses (``TransformerModelArgs``,
``Qwen3ModelArgs``), keep one RoPE buffer on the model and pass it to every block as
``block(x, freqs_cis, attention_masks, positions)``; the output layer is ``output``.
"""

from __future__ import annotations

import inspect
from typing import ClassVar

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel
from torchtitan.models.llama3.model.args import RoPEScalingArgs

from upipe_dtensor.models.long_context import LongContextModel

__all__ = ["OUTPUT_WEIGHT", "Decoder022", "RoPEScalingArgs", "VocabParallelEmbedding"]

OUTPUT_WEIGHT = "output.weight"
"""The output layer's weight in the state dict."""


def VocabParallelEmbedding() -> ParallelStyle:  # noqa: N802 (named as 0.3.0's style class)
    """torchtitan 0.2.2's ``nn.Embedding`` split by vocabulary rows over a ``tp`` mesh, its output
    reduced into the sequence-parallel shard (``models.tensor_parallel``): torch's row-wise
    style, as torchtitan 0.2.2 lays it out."""
    return RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
    )


class Decoder022(LongContextModel):
    """The long-context forward on a 0.2.2 model: its RoPE buffer, named by ``ROPE_BUFFER``
    (torchtitan's name in the family), holds our float64 inverse frequencies, computed by the
    family's ``_precompute_<ROPE_BUFFER>``."""

    ROPE_BUFFER: ClassVar[str] = ""
    OUTPUT_WEIGHT: ClassVar[str] = OUTPUT_WEIGHT

    def rope_frequencies(self) -> torch.Tensor:
        return getattr(self, self.ROPE_BUFFER)

    def block_arguments(self, rope, attention_masks, positions) -> tuple[tuple, dict]:
        # RoPE goes where 0.2.2's blocks take it (``freqs_cis``): this shard's table, or the
        # frequencies (``models.tt022.attention`` tells the two apart).
        rope = self.rope_frequencies() if rope is None else rope
        return (rope,), {"attention_masks": attention_masks, "positions": positions}

    def reset_rope(self, device: torch.device) -> None:
        precompute = getattr(self, f"_precompute_{self.ROPE_BUFFER}")
        setattr(self, self.ROPE_BUFFER, precompute().to(device))

    @staticmethod
    def init_block(block: nn.Module, device: torch.device) -> None:
        """Qwen3's block init takes the buffer device, Llama3's does not."""
        if "buffer_device" in inspect.signature(block.init_weights).parameters:
            block.init_weights(buffer_device=device)
        else:
            block.init_weights()
