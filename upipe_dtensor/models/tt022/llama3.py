"""torchtitan 0.2.2's Llama3, with an explicit ``head_dim`` and FFN size, and no RoPE position
table.

torchtitan 0.2.2 derives head_dim as dim // n_heads; the UPipe paper's 32B model (a Qwen3-32B
shape on the Llama3 architecture) has dim 5120 but 64 heads of 128 (64 * 128 != 5120). It also
derives the FFN size from dim, multiple_of and ffn_dim_multiplier, while a Hugging Face
config.json states ``intermediate_size``. ``Llama3`` subclasses torchtitan's ``Transformer`` and
only resizes the attention and MLP projections when those differ; blocks, init and forward are
torchtitan's. Its ``freqs_cis`` buffer holds the float64 inverse frequencies instead of a
max_seq_len-row complex table: the CP style computes the angles of its shard's positions only
(``kernels.rope``). So its attention runs under a CP style, which ``parallelize_llama`` always
applies (cp = 1 included); torchtitan's own attention expects the table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
from torchtitan.models.llama3.model.model import (
    Attention,
    FeedForward,
    Transformer,
    precompute_freqs_cis,
)
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

from upipe_dtensor.kernels.rope import rope_frequencies
from upipe_dtensor.models.hf_fields import check_supported, require, rope_from_hf
from upipe_dtensor.models.tt022 import Decoder022
from upipe_dtensor.models.tt022.attention import Attention022

__all__ = [
    "FLAVORS",
    "Llama3",
    "Llama3Args",
    "build_llama3",
    "torchtitan_model",
    "torchtitan_rope_table",
]

ATTENTION_CLASS = Attention
"""torchtitan's attention module of the family, which the CP styles replace."""
ATTENTION_ADAPTER = Attention022("llama3", "interleaved")
MLP_CLASS = FeedForward
HF_ROPE_PERMUTED = ("attention.wq.weight", "attention.wk.weight")
"""The weights Hugging Face stores permuted for its RoPE pairing (torchtitan's adapter permutes
them)."""


@dataclass
class Llama3Args(TransformerModelArgs):
    head_dim: int = 0
    """Per-head size; 0 means dim // n_heads (torchtitan's rule)."""
    ffn_dim: int = 0
    """SwiGLU hidden size; 0 means torchtitan's rule (from dim, multiple_of, ffn_dim_multiplier)."""

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def resolved_ffn_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        with torch.device("meta"):  # torchtitan's own rule, read off its module
            mlp = FeedForward(self.dim, 4 * self.dim, self.multiple_of, self.ffn_dim_multiplier)
        return mlp.w1.out_features


FLAVORS: dict[str, Llama3Args] = {
    # Small enough for a CPU laptop, GQA (2 query heads per KV head) so CP paths are exercised.
    "debugmodel": Llama3Args(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, rope_theta=500000
    ),
    **{
        name: Llama3Args(
            **{
                f.name: getattr(llama3_args[name], f.name)
                for f in dataclasses.fields(TransformerModelArgs)
            }
        )
        for name in ("8B", "70B")
    },
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


class Llama3(Decoder022, Transformer):
    """torchtitan ``Transformer`` with ``args.resolved_head_dim`` and ``args.resolved_ffn_dim``,
    and the long-context forward (``models.long_context``)."""

    def __init__(self, args: Llama3Args) -> None:
        super().__init__(args)
        head_dim, ffn_dim = args.resolved_head_dim, args.resolved_ffn_dim
        n_kv = args.n_kv_heads or args.n_heads
        for block in self.layers.values():
            if head_dim != args.dim // args.n_heads:
                attention = block.attention
                attention.head_dim = head_dim
                attention.wq = nn.Linear(args.dim, args.n_heads * head_dim, bias=False)
                attention.wk = nn.Linear(args.dim, n_kv * head_dim, bias=False)
                attention.wv = nn.Linear(args.dim, n_kv * head_dim, bias=False)
                attention.wo = nn.Linear(args.n_heads * head_dim, args.dim, bias=False)
            mlp = block.feed_forward
            if mlp.w1.out_features != ffn_dim:
                mlp.w1 = nn.Linear(args.dim, ffn_dim, bias=False)
                mlp.w2 = nn.Linear(ffn_dim, args.dim, bias=False)
                mlp.w3 = nn.Linear(args.dim, ffn_dim, bias=False)

    ROPE_BUFFER = "freqs_cis"

    def _precompute_freqs_cis(self) -> torch.Tensor:
        """The (head_dim/2,) float64 inverse frequencies, not torchtitan's position table."""
        args = self.model_args
        return rope_frequencies(args.resolved_head_dim, args.rope_theta, args.rope_scaling_args)


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


class Llama3HFAdapter(Llama3StateDictAdapter):
    """torchtitan's Llama3 <-> Hugging Face key map and RoPE permutation, for any head_dim.

    torchtitan 0.2.2 sizes wk's permutation with head_dim = dim // n_heads, which is wrong when
    n_heads * head_dim != dim (the 32B flavor; checkpoints with an explicit head_dim). The
    permutation needs only the head count: every other size is the weight's own shape, which is
    what torchtitan's ``_permute`` uses when no sizes are passed (as it does for wq).
    """

    def _permute(self, w, n_heads_arg, dim1=None, dim2=None):
        return super()._permute(w, n_heads_arg)

    def _reverse_permute(self, w, n_heads_arg, dim1=None, dim2=None):
        return super()._reverse_permute(w, n_heads_arg)


def hf_adapter(args: Llama3Args, hf_assets_path: str | None) -> Llama3HFAdapter:
    """The state-dict adapter between our names and Hugging Face's for ``args``."""
    return Llama3HFAdapter(args, hf_assets_path)


def torchtitan_model(
    *,
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    vocab_size: int,
    seq_len: int,
    rope_theta: float = 10000.0,
) -> Transformer:
    """torchtitan's own unsharded Llama3 of this shape (head_dim = dim / n_heads, its RoPE
    table, sdpa attention), with torchtitan's initial weights: the reference the styles are
    compared with (tests, ``gpu_check``)."""
    args = TransformerModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=vocab_size,
        max_seq_len=seq_len,
        rope_theta=rope_theta,
    )
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def torchtitan_rope_table(
    head_dim: int, seq_len: int, theta: float, scaling: RoPEScalingArgs
) -> torch.Tensor:
    """torchtitan's own Llama3 RoPE table for ``seq_len`` positions, (seq_len, head_dim/2)
    complex64, Llama 3.1's ``scaling`` included (``precompute_freqs_cis``): the reference the
    float64 angles of ``kernels.rope`` are checked against (tests)."""
    return precompute_freqs_cis(head_dim, seq_len, theta, scaling)


ARGS_CLASS = Llama3Args
MODEL_CLASS = Llama3
