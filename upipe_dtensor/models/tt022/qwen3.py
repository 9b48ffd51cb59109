"""torchtitan 0.2.2's dense Qwen3 on the long-context forward, with QK-norm under every CP style.

Qwen3 differs from Llama3 where the fused attention op looks: each query and key head is
RMS-normalised (``q_norm``/``k_norm``, weight over head_dim) before RoPE, and RoPE rotates the
halves' pairs (i, i + d/2) (Hugging Face's ``rotate_half``), not interleaved pairs; its MLP is
the same bias-free SwiGLU, its FFN size stated (``hidden_dim``), and its HF weights need no RoPE
permutation. ``Qwen3`` keeps torchtitan's blocks and init and holds float64 inverse frequencies
in ``rope_cache`` instead of a (max_seq_len, 2 * head_dim) table, as ``Llama3`` does with
``freqs_cis``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.models.qwen3 import qwen3_args
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
from torchtitan.models.qwen3.model.model import Attention, FeedForward, Qwen3Model
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from upipe_dtensor.kernels.rope import rope_frequencies
from upipe_dtensor.models.hf_fields import check_supported, require, rope_from_hf
from upipe_dtensor.models.tt022 import Decoder022
from upipe_dtensor.models.tt022.attention import Attention022

ATTENTION_CLASS = Attention
"""torchtitan's attention module of the family, which the CP styles replace."""
ATTENTION_ADAPTER = Attention022("qwen3", "half", "rms_norm")
MLP_CLASS = FeedForward
HF_ROPE_PERMUTED: tuple[str, ...] = ()
"""Qwen3's Hugging Face weights need no RoPE permutation."""


@dataclass
class Qwen3Args(Qwen3ModelArgs):
    """torchtitan's ``Qwen3ModelArgs`` read through the names the jobs use for every family."""

    rope_scaling_args: RoPEScalingArgs = field(
        default_factory=lambda: RoPEScalingArgs(scaling_factor=1.0)
    )
    """No RoPE scaling (factor 1): Qwen3's published dense models train without; YaRN-scaled
    checkpoints are refused when their config.json is read (``models.hf_config``)."""

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim

    @property
    def resolved_ffn_dim(self) -> int:
        return self.hidden_dim

    @property
    def multiple_of(self) -> int:  # the planner's floor sizes the MLP from the stated FFN size
        return 1


def _dense(name: str) -> Qwen3Args:
    """torchtitan's flavor, with an output layer of its own (FSDP2 here shards the output layer
    with the final norm, apart from the embeddings; a tied checkpoint loads into both)."""
    args = qwen3_args[name]
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(Qwen3ModelArgs)}
    return Qwen3Args(**fields | {"enable_weight_tying": False})


FLAVORS: dict[str, Qwen3Args] = {
    # Small enough for a CPU laptop: GQA (2 query heads per KV head), head_dim 32, QK-norm.
    "debugmodel": Qwen3Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        hidden_dim=768,
        vocab_size=2048,
        rope_theta=1_000_000,
    ),
    **{name: _dense(name) for name in ("0.6B", "1.7B", "4B", "8B", "14B", "32B")},
}
"""torchtitan's dense Qwen3 flavors (0.6B-4B untied here, see ``_dense``)."""


class Qwen3(Decoder022, Qwen3Model):
    """torchtitan's ``Qwen3Model`` with the long-context forward (``models.long_context``)."""

    ROPE_BUFFER = "rope_cache"

    def _precompute_rope_cache(self) -> torch.Tensor:
        """The (head_dim/2,) float64 inverse frequencies, not torchtitan's position table."""
        args = self.model_args
        return rope_frequencies(args.head_dim, args.rope_theta, args.rope_scaling_args)


_SUPPORTED = {"attention_bias": False, "hidden_act": "silu", "use_sliding_window": False}
"""config.json fields and the only value our Qwen3 implements."""
_SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)


def args_from_hf(config: dict[str, Any], source: str) -> Qwen3Args:
    """The ``Qwen3Args`` of a Hugging Face Qwen3 ``config.json`` (dense; ``source`` names it in
    errors). Tied embeddings load as an output layer of its own (``checkpointing.weights``)."""
    check_supported(config, _SUPPORTED, source)
    require(config, _SHAPE_KEYS, source, "Qwen3")
    theta, scaling = rope_from_hf(config, source)
    if scaling.scaling_factor != 1:
        raise ValueError(f"{source}: Qwen3 with Llama3 RoPE scaling is not a Qwen3 model we know")
    return Qwen3Args(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        hidden_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        enable_weight_tying=False,
    )


def hf_adapter(args: Qwen3Args, hf_assets_path: str | None) -> Qwen3StateDictAdapter:
    """torchtitan's state-dict adapter between our names and Hugging Face's for ``args``."""
    return Qwen3StateDictAdapter(args, hf_assets_path)


def torchtitan_model(
    *,
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    hidden_dim: int,
    vocab_size: int,
    seq_len: int,
) -> Qwen3Model:
    """torchtitan's own unsharded Qwen3 of this shape (its RoPE table, sdpa attention), with
    torchtitan's initial weights: the reference the styles are compared with."""
    args = Qwen3ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        hidden_dim=hidden_dim,
        vocab_size=vocab_size,
        max_seq_len=seq_len,
        rope_theta=10000.0,
    )
    model = Qwen3Model(args)
    with torch.no_grad():
        model.init_weights()
    return model


ARGS_CLASS = Qwen3Args
MODEL_CLASS = Qwen3
