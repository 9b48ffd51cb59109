"""torchtitan 0.3.0's Llama3, built from our args with an explicit ``head_dim`` and FFN size, and
no RoPE position table.

The model is torchtitan's ``Llama3Model``, its config made by torchtitan's own layer builder and
initialisers (``_build_llama3_layers``: per-layer depth-scaled inits) from ``Llama3Args``; only
when ``head_dim`` differs from dim // n_heads (the UPipe paper's 32B shape, checkpoints stating
one) is each layer's attention rebuilt by torchtitan's ``make_gqa_config`` with that head_dim and
the same inits. Separate ``wq``/``wk``/``wv`` (torchtitan's flavors fuse them; the styles take
both, ``models.tt030.attention``), so checkpoints name the weights as Hugging Face's adapter
does. Each layer's ``rope`` holds the float64 inverse frequencies (``InterleavedFrequencyRoPE``),
and its blocks (``Llama3Block``) hand the attention this shard's RoPE table by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.models.common import (
    ComplexRoPE,
    Embedding,
    FeedForward,
    GQAttention,
    Linear,
    RMSNorm,
    ScaledDotProductAttention,
    compute_ffn_hidden_dim,
)
from torchtitan.models.common.config_utils import make_gqa_config
from torchtitan.models.llama3 import (
    _EMBEDDING_INIT,
    _NORM_INIT,
    _build_llama3_layers,
    _output_linear_init,
    llama3_configs,
)
from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

from upipe_dtensor.models.hf_fields import check_supported, require, rope_from_hf
from upipe_dtensor.models.tt030 import (
    Decoder030,
    DecoderArgs,
    InterleavedFrequencyRoPE,
    RoPEScalingArgs,
    scaling_of,
    with_block_class,
    with_norm_eps,
)
from upipe_dtensor.models.tt030.attention import GQA_ADAPTER

__all__ = [
    "FLAVORS",
    "Llama3",
    "Llama3Args",
    "build_llama3",
    "torchtitan_model",
    "torchtitan_rope_table",
]

ATTENTION_CLASS = GQAttention
"""torchtitan's attention module of the family, which the CP styles replace (Qwen3's too)."""
ATTENTION_ADAPTER = GQA_ADAPTER
MLP_CLASS = FeedForward
HF_ROPE_PERMUTED = ("attention.qkv_linear.wq.weight", "attention.qkv_linear.wk.weight")
"""The weights Hugging Face stores permuted for its RoPE pairing (torchtitan's adapter permutes
them)."""


@dataclass
class Llama3Args(DecoderArgs):
    """Llama3's shape: the FFN size from torchtitan's rule unless stated, Llama 3.1's RoPE
    scaling by default (0.2.2's ``TransformerModelArgs`` defaults)."""

    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_scaling_args: RoPEScalingArgs = field(default_factory=RoPEScalingArgs)

    @property
    def resolved_ffn_dim(self) -> int:
        return self.ffn_dim or compute_ffn_hidden_dim(
            self.dim, multiple_of=self.multiple_of, ffn_dim_multiplier=self.ffn_dim_multiplier
        )

    @property
    def flops_head_dims(self) -> int:
        """torchtitan's Llama3 counts 2 * dim / n_heads (``Llama3Model.Config``), whatever the
        head_dim."""
        return 2 * (self.dim // self.n_heads)


def _torchtitan_flavor(name: str) -> Llama3Args:
    """The args of torchtitan's flavor ``name``, read off its config."""
    config = llama3_configs[name](attn_backend="flex")
    attention = config.layers[0].attention
    return Llama3Args(
        dim=config.dim,
        n_layers=len(config.layers),
        n_heads=attention.n_heads,
        n_kv_heads=attention.n_kv_heads,
        vocab_size=config.vocab_size,
        ffn_dim=config.layers[0].feed_forward.w1.out_features,
        norm_eps=config.norm.eps,
        rope_theta=attention.rope.theta,
        rope_scaling_args=scaling_of(attention.rope),
        max_seq_len=attention.rope.max_seq_len,
    )


FLAVORS: dict[str, Llama3Args] = {
    # Small enough for a CPU laptop, GQA (2 query heads per KV head) so CP paths are exercised.
    "debugmodel": Llama3Args(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, rope_theta=500000
    ),
    "8B": _torchtitan_flavor("8B"),
    "70B": _torchtitan_flavor("70B"),
    # The UPipe paper's "32B": 64 layers, dim 5120, 64 query / 8 KV heads of 128, FFN 25600.
    "32B": Llama3Args(
        dim=5120,
        n_layers=64,
        n_heads=64,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim_multiplier=1.875,
        multiple_of=1024,
        rope_theta=1_000_000,
        vocab_size=128256,
    ),
}


class Llama3Block(Llama3TransformerBlock):
    """torchtitan's Llama3 block, handing its attention this shard's RoPE table by name: 0.3.0's
    blocks pass the attention only masks and positions, and the table is computed once per
    forward (``models.long_context``), not once per layer. Its forward is torchtitan's
    otherwise."""

    @dataclass(kw_only=True, slots=True)
    class Config(Llama3TransformerBlock.Config):
        pass

    def forward(
        self,
        x: torch.Tensor,
        attention_masks: Any,
        positions: torch.Tensor | None = None,
        *,
        rope: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), attention_masks, positions, rope=rope)
        return h + self.feed_forward(self.ffn_norm(h))


def model_config(args: Llama3Args) -> Llama3Model.Config:
    """torchtitan's ``Llama3Model.Config`` of ``args``, by torchtitan's builders and inits."""
    head_dim, n_kv = args.resolved_head_dim, args.n_kv_heads or args.n_heads
    rope = args.rope_config(InterleavedFrequencyRoPE)
    layers = _build_llama3_layers(
        n_layers=args.n_layers,
        dim=args.dim,
        n_heads=args.n_heads,
        n_kv_heads=n_kv,
        hidden_dim=args.resolved_ffn_dim,
        rope=rope,
        fuse_qkv=False,
        attn_backend="flex",
    )
    if head_dim != args.dim // args.n_heads:
        for layer in layers:
            attention = layer.attention
            layer.attention = make_gqa_config(
                dim=args.dim,
                n_heads=args.n_heads,
                n_kv_heads=n_kv,
                head_dim=head_dim,
                wqkv_param_init=attention.qkv_linear.wq.param_init,
                wo_param_init=attention.wo.param_init,
                inner_attention=attention.inner_attention,
                rope=rope,
            )
    config = Llama3Model.Config(
        dim=args.dim,
        vocab_size=args.vocab_size,
        tok_embeddings=Embedding.Config(
            num_embeddings=args.vocab_size, embedding_dim=args.dim, param_init=_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=args.dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(
            in_features=args.dim,
            out_features=args.vocab_size,
            param_init=_output_linear_init(args.dim),
        ),
        layers=with_block_class(layers, Llama3Block),
    )
    return with_norm_eps(config, args.norm_eps)


class Llama3(Decoder030, Llama3Model):
    """torchtitan's ``Llama3Model`` of ``Llama3Args``, with the long-context forward
    (``models.long_context``)."""

    def __init__(self, args: Llama3Args) -> None:
        super().__init__(model_config(args))
        self.model_args = args


def build_llama3(flavor: str, *, seq_len: int, vocab_size: int | None = None) -> Llama3:
    """The flavor's model for ``seq_len``-token sequences (build under a meta device for 8B+)."""
    if flavor not in FLAVORS:
        raise ValueError(f"unknown model flavor {flavor!r}; choose one of {sorted(FLAVORS)}")
    args = dataclasses.replace(FLAVORS[flavor], max_seq_len=seq_len)
    if vocab_size is not None:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    return Llama3(args)


_SUPPORTED = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
"""config.json fields and the only value our Llama3 implements."""
_SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


def args_from_hf(config: dict[str, Any], source: str) -> Llama3Args:
    """The ``Llama3Args`` of a Hugging Face Llama ``config.json`` (``source`` names it in
    errors)."""
    check_supported(config, _SUPPORTED, source)
    require(config, _SHAPE_KEYS, source, "Llama")
    theta, scaling = rope_from_hf(config, source)
    n_heads = config["num_attention_heads"]
    return Llama3Args(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
        ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling_args=scaling,
    )


def hf_adapter(args: Llama3Args, hf_assets_path: str | None) -> Llama3StateDictAdapter:
    """torchtitan's state-dict adapter between our names and Hugging Face's for ``args`` (0.3.0's
    permutes wk for any head_dim)."""
    return Llama3StateDictAdapter(model_config(args), hf_assets_path)


def torchtitan_model(
    *,
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    vocab_size: int,
    seq_len: int,
    rope_theta: float = 10000.0,
) -> Llama3Model:
    """torchtitan's own unsharded Llama3 of this shape (head_dim = dim / n_heads, fused
    ``wqkv`` as its flavors, its RoPE table), with torchtitan's initial weights: the reference
    the styles are compared with (tests, ``gpu_check``). Its inner attention is torchtitan's
    ``ScaledDotProductAttention`` (causal, no mask: 0.3.0's flavors allow only flex or varlen,
    whose masks a reference run one document at a time does not need)."""
    layers = _build_llama3_layers(
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
        rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=seq_len, theta=rope_theta),
        fuse_qkv=True,
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab_size,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim, param_init=_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab_size, param_init=_output_linear_init(dim)
        ),
        layers=layers,
    ).build()
    with torch.no_grad():
        model.init_weights()
    return model


def torchtitan_rope_table(
    head_dim: int, seq_len: int, theta: float, scaling: RoPEScalingArgs
) -> torch.Tensor:
    """torchtitan's own Llama3 RoPE table for ``seq_len`` positions, (seq_len, head_dim/2)
    complex64, Llama 3.1's ``scaling`` included (the cache of torchtitan's ``ComplexRoPE``,
    configured as our models configure theirs): the reference the float64 angles of
    ``kernels.rope`` are checked against (tests)."""
    args = Llama3Args(
        head_dim=head_dim, rope_theta=theta, rope_scaling_args=scaling, max_seq_len=seq_len
    )
    return ComplexRoPE(args.rope_config(ComplexRoPE)).cache


ARGS_CLASS = Llama3Args
MODEL_CLASS = Llama3
