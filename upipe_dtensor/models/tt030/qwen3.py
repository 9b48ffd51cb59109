"""torchtitan 0.3.0's dense Qwen3 on the long-context forward, with QK-norm under every CP style.

Qwen3 differs from Llama3 where the fused attention op looks: each query and key head is
RMS-normalised (``q_norm``/``k_norm``, weight over head_dim) before RoPE, and RoPE rotates the
halves' pairs (i, i + d/2) (torchtitan's ``CosSinRoPE``, Hugging Face's ``rotate_half``), not
interleaved pairs; its MLP is the same bias-free SwiGLU, its FFN size stated, and its HF weights
need no RoPE permutation. ``Qwen3`` is torchtitan's ``Qwen3Model`` from torchtitan's own layer
builder (``_build_qwen3_layers``) with separate ``wq``/``wk``/``wv``, untied embeddings and
float64 inverse frequencies in each layer's ``rope`` (``HalfFrequencyRoPE``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.models.common import (
    CosSinRoPE,
    Embedding,
    FeedForward,
    GQAttention,
    Linear,
    ScaledDotProductAttention,
)
from torchtitan.models.qwen3 import (
    _EMBEDDING_INIT,
    _LINEAR_INIT,
    _build_qwen3_layers,
    _qwen3_norm,
    qwen3_configs,
)
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

from upipe_dtensor.models.hf_fields import check_supported, require, rope_from_hf
from upipe_dtensor.models.tt030 import (
    Decoder030,
    DecoderArgs,
    HalfFrequencyRoPE,
    with_block_class,
    with_norm_eps,
)
from upipe_dtensor.models.tt030.attention import GQA_ADAPTER

ATTENTION_CLASS = GQAttention
"""torchtitan's attention module of the family, which the CP styles replace (Llama3's too)."""
ATTENTION_ADAPTER = GQA_ADAPTER
MLP_CLASS = FeedForward
HF_ROPE_PERMUTED: tuple[str, ...] = ()
"""Qwen3's Hugging Face weights need no RoPE permutation."""


@dataclass
class Qwen3Args(DecoderArgs):
    """Qwen3's shape: head_dim and FFN size stated, no RoPE scaling (Qwen3's published dense
    models train without; YaRN-scaled checkpoints are refused when their config.json is read)."""

    norm_eps: float = 1e-6


def _torchtitan_flavor(name: str) -> Qwen3Args:
    """The args of torchtitan's dense flavor ``name``, read off its config, with an output
    layer of its own (FSDP2 here shards the output layer with the final norm, apart from the
    embeddings; a tied checkpoint loads into both)."""
    config = qwen3_configs[name](attn_backend="flex")
    attention = config.layers[0].attention
    return Qwen3Args(
        dim=config.dim,
        n_layers=len(config.layers),
        n_heads=attention.n_heads,
        n_kv_heads=attention.n_kv_heads,
        head_dim=attention.head_dim,
        ffn_dim=config.layers[0].feed_forward.w1.out_features,
        vocab_size=config.vocab_size,
        norm_eps=config.norm.eps,
        rope_theta=attention.rope.theta,
        max_seq_len=attention.rope.max_seq_len,
    )


FLAVORS: dict[str, Qwen3Args] = {
    # Small enough for a CPU laptop: GQA (2 query heads per KV head), head_dim 32, QK-norm.
    "debugmodel": Qwen3Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        ffn_dim=768,
        vocab_size=2048,
        rope_theta=1_000_000,
    ),
    **{name: _torchtitan_flavor(name) for name in ("0.6B", "1.7B", "4B", "8B", "14B", "32B")},
}
"""torchtitan's dense Qwen3 flavors (0.6B-4B untied here, see ``_torchtitan_flavor``)."""


class Qwen3Block(Qwen3TransformerBlock):
    """torchtitan's Qwen3 block, handing its attention this shard's RoPE table by name (as
    ``llama3.Llama3Block``); its forward is torchtitan's otherwise."""

    @dataclass(kw_only=True, slots=True)
    class Config(Qwen3TransformerBlock.Config):
        pass

    def forward(
        self,
        x: torch.Tensor,
        attention_masks: Any,
        positions: torch.Tensor | None = None,
        *,
        rope: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), attention_masks, positions, rope=rope)
        mlp = self.moe if self.moe_enabled else self.feed_forward
        return x + mlp(self.ffn_norm(x))


def decoder_config(args: Qwen3Args, layers: list[Any]) -> Qwen3Model.Config:
    """torchtitan's ``Qwen3Model.Config`` of ``args`` around the block configs ``layers``
    (embeddings, final norm, output layer by torchtitan's inits; every norm's epsilon ``args``'),
    for every Qwen3 family."""
    config = Qwen3Model.Config(
        dim=args.dim,
        vocab_size=args.vocab_size,
        norm=_qwen3_norm(args.dim),
        tok_embeddings=Embedding.Config(
            num_embeddings=args.vocab_size, embedding_dim=args.dim, param_init=_EMBEDDING_INIT
        ),
        lm_head=Linear.Config(
            in_features=args.dim, out_features=args.vocab_size, param_init=_LINEAR_INIT
        ),
        layers=layers,
    )
    return with_norm_eps(config, args.norm_eps)


def model_config(args: Qwen3Args) -> Qwen3Model.Config:
    """torchtitan's ``Qwen3Model.Config`` of ``args``, by torchtitan's builders and inits."""
    return decoder_config(
        args,
        with_block_class(
            _build_qwen3_layers(
                n_layers=args.n_layers,
                dim=args.dim,
                n_heads=args.n_heads,
                n_kv_heads=args.n_kv_heads or args.n_heads,
                head_dim=args.resolved_head_dim,
                hidden_dim=args.resolved_ffn_dim,
                fuse_qkv=False,
                attn_backend="flex",
                rope=args.rope_config(HalfFrequencyRoPE),
            ),
            Qwen3Block,
        ),
    )


class Qwen3(Decoder030, Qwen3Model):
    """torchtitan's ``Qwen3Model`` of ``Qwen3Args``, with the long-context forward
    (``models.long_context``)."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(model_config(args))
        self.model_args = args


SUPPORTED = {"attention_bias": False, "hidden_act": "silu", "use_sliding_window": False}
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


def decoder_fields(config: dict[str, Any], source: str, model: str) -> dict[str, Any]:
    """The args of a Qwen3 ``config.json`` every Qwen3 family reads (the attention, the
    widths, the norm and RoPE), by our args' names; ``model`` names it in errors."""
    theta, scaling = rope_from_hf(config, source)
    if scaling.scaling_factor != 1:
        raise ValueError(f"{source}: {model} with Llama3 RoPE scaling is not a model we know")
    return dict(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        vocab_size=config["vocab_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
    )


def args_from_hf(config: dict[str, Any], source: str) -> Qwen3Args:
    """The ``Qwen3Args`` of a Hugging Face Qwen3 ``config.json`` (dense; ``source`` names it in
    errors). Tied embeddings load as an output layer of its own (``checkpointing.weights``)."""
    check_supported(config, SUPPORTED, source)
    require(config, _SHAPE_KEYS, source, "Qwen3")
    return Qwen3Args(**decoder_fields(config, source, "Qwen3"), ffn_dim=config["intermediate_size"])


def hf_adapter(args: Qwen3Args, hf_assets_path: str | None) -> Qwen3StateDictAdapter:
    """torchtitan's state-dict adapter between our names and Hugging Face's for ``args``."""
    return Qwen3StateDictAdapter(model_config(args), hf_assets_path)


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
    """torchtitan's own unsharded Qwen3 of this shape (separate ``wq``/``wk``/``wv``, the
    layout torchtitan's ``debugmodel_non_fused_qkv`` keeps covered; its RoPE table; causal
    ``ScaledDotProductAttention``, as ``llama3.torchtitan_model`` says why), with torchtitan's
    initial weights: the reference the styles are compared with."""
    layers = _build_qwen3_layers(
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        hidden_dim=hidden_dim,
        fuse_qkv=False,
        attn_backend="flex",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=seq_len, theta=10000.0),
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = Qwen3Model.Config(
        dim=dim,
        vocab_size=vocab_size,
        norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim, param_init=_EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=_LINEAR_INIT),
        layers=layers,
    ).build()
    with torch.no_grad():
        model.init_weights()
    return model


ARGS_CLASS = Qwen3Args
MODEL_CLASS = Qwen3
