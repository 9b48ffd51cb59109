"""The model families on torchtitan 0.3.0 (``llama3``, ``qwen3``), and what they share here.

0.3.0 builds its models from ``Config`` dataclasses (``Llama3Model.Config``: embeddings, norm,
``lm_head``, one ``TransformerBlock.Config`` per layer) and has no model-args class; the jobs,
the planner and the Hugging Face code read a model's shape through one flat args dataclass per
family (``DecoderArgs``: the names 0.2.2's ``TransformerModelArgs`` used), from which each
family module builds torchtitan's config with torchtitan's own builders and initialisers. Each
attention layer holds its RoPE in its own ``rope`` part: ours holds the (head_dim/2,) float64
inverse frequencies instead of torchtitan's (max_seq_len x ...) table (``FrequencyRoPE``), and
the CP style computes the angles of its shard's positions only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE, RoPE
from torchtitan.models.utils import get_dense_model_nparams_and_flops

from upipe_dtensor.kernels.rope import rope_frequencies
from upipe_dtensor.models.long_context import LongContextModel

OUTPUT_WEIGHT = "lm_head.weight"
"""The output layer's weight in the state dict (0.2.2: ``output.weight``)."""


@dataclass
class RoPEScalingArgs:
    """Llama 3.1's RoPE frequency scaling, which 0.3.0 keeps in each ``RoPE.Config``
    (``scaling = "llama"`` and these fields, with 0.2.2's ``RoPEScalingArgs`` defaults)."""

    scaling_factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class DecoderArgs:
    """A dense decoder's shape, by the names the jobs use for every family."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    head_dim: int = 0
    """Per-head size; 0 means dim // n_heads."""
    ffn_dim: int = 0
    """SwiGLU hidden size (the family's rule when 0)."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling_args: RoPEScalingArgs = field(
        default_factory=lambda: RoPEScalingArgs(scaling_factor=1.0)
    )
    max_seq_len: int = 131072

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def resolved_ffn_dim(self) -> int:
        return self.ffn_dim

    @property
    def flops_head_dims(self) -> int:
        """The q/k plus v head size in torchtitan's attention FLOPs count of the family."""
        return 2 * self.resolved_head_dim

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """torchtitan's parameter and FLOPs-per-token count of ``model`` with this shape (as
        0.2.2's args and 0.3.0's configs give it), ``n_layers`` taken from these args."""
        return get_dense_model_nparams_and_flops(
            model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            head_dims=self.flops_head_dims,
            seq_len=seq_len,
        )

    def rope_config(self, rope_class: type[RoPE]) -> RoPE.Config:
        """``rope_class``'s config of this RoPE (theta, Llama3 scaling, head_dim)."""
        scaling = self.rope_scaling_args
        return rope_class.Config(
            dim=self.resolved_head_dim,
            max_seq_len=self.max_seq_len,
            theta=self.rope_theta,
            scaling="none" if scaling.scaling_factor == 1 else "llama",
            **dataclasses.asdict(scaling),
        )


def with_norm_eps(config: Any, eps: float) -> Any:
    """``config`` with every RMSNorm's epsilon (blocks, QK-norm, final norm) set to ``eps``."""
    for _, norm, _, _ in config.traverse(RMSNorm.Config, recurse=True):
        norm.eps = eps
    return config


def scaling_of(config: RoPE.Config) -> RoPEScalingArgs:
    """The Llama3 scaling of a torchtitan RoPE config (factor 1: none)."""
    if config.scaling == "none":
        return RoPEScalingArgs(scaling_factor=1.0)
    if config.scaling != "llama":
        raise ValueError(f"RoPE scaling {config.scaling!r} is not supported (only 'llama')")
    return RoPEScalingArgs(
        config.scaling_factor,
        config.low_freq_factor,
        config.high_freq_factor,
        config.original_max_position_embeddings,
    )


class FrequencyRoPE:
    """A torchtitan RoPE whose ``cache`` is the (head_dim/2,) float64 inverse frequencies
    (``kernels.rope.rope_frequencies``, Llama3's scaling included) instead of the position table:
    at 5M tokens torchtitan's table is GiBs per layer, in float32 angles. Only the CP styles read
    it (our models' attention always runs under one, cp = 1 included)."""

    def _precompute_cache(self) -> torch.Tensor:
        return rope_frequencies(self.config.dim, self.config.theta, scaling_of(self.config))


class InterleavedFrequencyRoPE(FrequencyRoPE, ComplexRoPE):
    """Llama3's RoPE (interleaved pairs, torchtitan's ``ComplexRoPE``) as frequencies."""

    @dataclass(kw_only=True, slots=True)
    class Config(ComplexRoPE.Config):
        pass


class HalfFrequencyRoPE(FrequencyRoPE, CosSinRoPE):
    """Qwen3's RoPE (rotate-half pairs, torchtitan's ``CosSinRoPE``) as frequencies."""

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass


def with_block_class(layers: list[Any], block_class: type[nn.Module]) -> list[Any]:
    """torchtitan's block configs (from its layer builders, with its inits) as configs of
    ``block_class``, a subclass of the block they build, so the model builds ``block_class``."""
    return [
        block_class.Config(**{f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)})
        for layer in layers
    ]


class VocabParallelEmbedding(ParallelStyle):
    """torchtitan 0.3.0's ``Embedding`` split by vocabulary rows over a ``tp`` mesh, its output
    reduced into the sequence-parallel shard (``models.tensor_parallel``): the module computes
    its rows' part itself once given its ``tp_group`` (torch's ``RowwiseParallel`` computes on
    DTensors, which this module's forward unwraps)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.tp_group = device_mesh.get_group()

        def rows(name: str, part: nn.Module, mesh: DeviceMesh) -> None:
            if part is module:
                weight = distribute_tensor(part.weight, mesh, [Shard(0)])
                part.register_parameter("weight", nn.Parameter(weight))

        def reduced(part: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
            partial = DTensor.from_local(output, mesh, [Partial()], run_check=False)
            return partial.redistribute(mesh, [Shard(1)])

        return distribute_module(module, device_mesh, rows, output_fn=reduced)


class Decoder030(LongContextModel):
    """The long-context forward on a 0.3.0 ``Decoder``: RoPE frequencies from the attention's
    ``rope`` part, blocks called as ``block(x, attention_masks, positions, rope=table)`` (the
    families' blocks, ``with_block_class``), the output layer ``lm_head``."""

    model_args: DecoderArgs
    OUTPUT_WEIGHT: ClassVar[str] = OUTPUT_WEIGHT

    @property
    def output(self) -> nn.Module:
        """The output layer (``lm_head``), by the name the jobs use for every generation."""
        return self.lm_head

    def rope_frequencies(self) -> torch.Tensor:
        return next(iter(self.layers.values())).attention.rope.cache

    def block_arguments(self, rope, attention_masks, positions) -> tuple[tuple, dict]:
        # 0.3.0's blocks take no RoPE argument; the families' blocks (``with_block_class``) hand
        # this shard's table to the attention by name.
        return (attention_masks, positions), {"rope": rope}

    def reset_rope(self, device: torch.device) -> None:
        """One tensor of frequencies on ``device``, shared by every layer's ``rope`` (they are
        equal: as 0.2.2's model holds one buffer, not one per layer)."""
        ropes = [block.attention.rope for block in self.layers.values()]
        ropes[0].init_states(buffer_device=device)
        for rope in ropes[1:]:
            rope.cache = ropes[0].cache

    @staticmethod
    def init_block(block: nn.Module, device: torch.device) -> None:
        block.init_states(buffer_device=device)
