"""Tensor parallelism over a ``tp`` mesh for our families' models and torchtitan's own of the
installed generation, laid out as torchtitan lays out Llama3 and Qwen3 (Megatron's layout with
sequence parallelism):

- each block's attention: Q/K/V column-wise, ``wo`` row-wise, per-head norms replicated (the
  attention adapter names its parts, ``parallel.tensor_parallel``); the context-parallel style
  applied afterwards runs on each rank's heads, gathers the block's sequence-parallel input and
  reduces its output back into it;
- the SwiGLU MLP: its input gathered over ``tp``, ``w1``/``w3`` column-wise, ``w2`` row-wise into
  the sequence-parallel shard;
- the norms sequence-parallel: between the blocks each rank holds 1/tp of its context-parallel
  shard's tokens, so per-token activations (and their checkpoints) are divided by tp;
- the embeddings row-wise (vocabulary-parallel), reduced into the sequence-parallel shard.

The residual stream between the modules stays a ``Shard(1)`` DTensor (as in torchtitan 0.3.0),
so each module's output lands in the layout its input came in.

The output layer is either column-wise into whole logits (``logits=True``: a model whose own
forward returns logits, torchtitan's), or replicated (``logits=False``: our long-context forward,
whose loss each rank computes on its own tokens, ``models.long_context``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from upipe_dtensor.memory.tiled_mlp import is_tiled_mlp
from upipe_dtensor.models.generation import generation_module
from upipe_dtensor.parallel.attention_interface import attention_adapter
from upipe_dtensor.parallel.tensor_parallel import ReplicateParameters


def block_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    """One block's plan, by submodule name. A tiled MLP (``memory.tiled_mlp``: apply it first)
    takes its sequence-parallel input as it arrives and gathers it itself."""
    attention = block.attention
    plan: dict[str, ParallelStyle] = {
        f"attention.{name}": style
        for name, style in attention_adapter(attention).tensor_parallel_plan(attention).items()
    }
    plan.update(
        {
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }
    )
    if not is_tiled_mlp(block.feed_forward):
        plan["feed_forward"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
    return plan


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, *, logits: bool) -> None:
    """Shard ``model`` over the 1-D ``mesh`` (before any context-parallel style, compile or
    FSDP); ``logits`` chooses the output layer's layout (module docstring)."""
    generation = generation_module()
    output = generation.OUTPUT_WEIGHT.removesuffix(".weight")
    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": generation.VocabParallelEmbedding(),
            "norm": SequenceParallel(),
            output: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
            if logits
            else ReplicateParameters(),
        },
    )
    for block in model.layers.values():
        parallelize_module(block, mesh, block_plan(block))
