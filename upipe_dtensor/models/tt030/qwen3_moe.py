"""torchtitan 0.3.0's Qwen3-MoE on the long-context forward: Qwen3's attention (QK-norm,
rotate-half RoPE; the same adapter, so every CP style runs on it) and torchtitan's MoE layer in
every block (token-choice top-k softmax router, grouped experts, auxiliary-loss-free load
balancing by an expert bias), built by torchtitan's own layer builder
(``_build_qwen3_moe_layers``) with separate ``wq``/``wk``/``wv``.

One change to torchtitan's layer: the grouped experts run as ``memory.grouped_swiglu`` computes
them (``RecomputedGroupedExperts``), in the activations' dtype and without keeping their hidden
states for backward. Under FSDP's bf16 mixed precision that dtype is torchtitan's bf16; in
float32 it stays float32, where torchtitan would round the experts to bf16 (so no float32 check
against ``transformers`` or float64 could pass). Every token goes to its top-k experts
(torchtitan's ``LocalTokenDispatcher`` drops none).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import nn
from torchtitan.models.common.moe import GroupedExperts, MoE
from torchtitan.models.qwen3 import (
    _build_qwen3_moe_layers,
    qwen3_configs,
)
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.models.utils import get_moe_model_nparams_and_flops

from upipe_dtensor.memory.grouped_swiglu import GroupedSwiGLUForward
from upipe_dtensor.models.hf_fields import check_supported, require
from upipe_dtensor.models.tt030 import Decoder030, HalfFrequencyRoPE, with_block_class
from upipe_dtensor.models.tt030.attention import GQA_ADAPTER
from upipe_dtensor.models.tt030.expert_parallel import apply_expert_parallel, balanced_routing
from upipe_dtensor.models.tt030.qwen3 import (
    ATTENTION_CLASS,
    SUPPORTED,
    Qwen3Args,
    Qwen3Block,
    decoder_config,
    decoder_fields,
)

__all__ = ["ATTENTION_CLASS"]

ATTENTION_ADAPTER = GQA_ADAPTER
"""Qwen3's attention: the dense family's adapter."""
HF_ROPE_PERMUTED: tuple[str, ...] = ()
MIXTURE_OF_EXPERTS = True
EXPERT_PARALLEL = apply_expert_parallel
BALANCED_ROUTING = balanced_routing
"""How the family's experts split over an ``ep`` mesh (``models.tt030.expert_parallel``)."""
MLP_CLASS = MoE
"""torchtitan's MoE block (what ``memory.tiled_moe`` tiles)."""


@dataclass
class Qwen3MoeArgs(Qwen3Args):
    """Qwen3-MoE's shape: Qwen3's, with every block's MLP a mixture of ``num_experts`` SwiGLU
    experts of hidden size ``ffn_dim``, ``top_k`` of them per token."""

    num_experts: int = 8
    top_k: int = 2
    route_norm: bool = True
    """Renormalise each token's top-k scores to sum to 1 (Hugging Face's ``norm_topk_prob``)."""
    load_balance_coeff: float | None = 1e-3
    """torchtitan's auxiliary-loss-free load balancing: the expert bias moves by this much per
    optimizer step toward the under-used experts (None: off)."""
    force_load_balance: bool = False
    """Route round-robin instead of by score (``[model] moe_force_load_balance``)."""

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """torchtitan's MoE count: every parameter, and the FLOPs of the active ones (top-k
        experts) per token."""
        return get_moe_model_nparams_and_flops(
            model_config(self), model, self.n_heads, self.flops_head_dims, seq_len
        )


class RecomputedGroupedExperts(GroupedSwiGLUForward, GroupedExperts):
    """torchtitan's ``GroupedExperts`` (its weights, its initialisation) computed by
    ``memory.grouped_swiglu``: in the dtype of the tokens it is given, where torchtitan's always
    casts to bf16 (module docstring), and without keeping hidden states for backward."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass


def _torchtitan_flavor(name: str) -> Qwen3MoeArgs:
    """The args of torchtitan's Qwen3-MoE flavor ``name``, read off its config (an output
    layer of its own, as the dense family's)."""
    config = qwen3_configs[name](attn_backend="flex")
    attention, moe = config.layers[0].attention, config.layers[0].moe
    return Qwen3MoeArgs(
        dim=config.dim,
        n_layers=len(config.layers),
        n_heads=attention.n_heads,
        n_kv_heads=attention.n_kv_heads,
        head_dim=attention.head_dim,
        ffn_dim=moe.routed_experts.inner_experts.hidden_dim,
        vocab_size=config.vocab_size,
        norm_eps=config.norm.eps,
        rope_theta=attention.rope.theta,
        max_seq_len=attention.rope.max_seq_len,
        num_experts=moe.num_experts,
        top_k=moe.router.top_k,
        route_norm=moe.router.route_norm,
        load_balance_coeff=moe.load_balance_coeff,
    )


FLAVORS: dict[str, Qwen3MoeArgs] = {
    # Small enough for a CPU laptop: the dense debug model's attention, 8 experts, top 2.
    "debugmodel": Qwen3MoeArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        ffn_dim=256,
        vocab_size=2048,
        rope_theta=1_000_000,
        num_experts=8,
        top_k=2,
    ),
    **{name: _torchtitan_flavor(name) for name in ("debugmodel_moe", "30B-A3B", "235B-A22B")},
}
"""Our CPU debug flavor and torchtitan's Qwen3-MoE flavors (``debugmodel_moe``: the shapes of
its ``qwen3_moe_debug`` job)."""


def model_config(args: Qwen3MoeArgs) -> Qwen3Model.Config:
    """torchtitan's ``Qwen3Model.Config`` of ``args``, by torchtitan's builders and inits."""
    layers = _build_qwen3_moe_layers(
        n_layers=args.n_layers,
        dim=args.dim,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads or args.n_heads,
        head_dim=args.resolved_head_dim,
        moe_hidden_dim=args.resolved_ffn_dim,
        num_experts=args.num_experts,
        top_k=args.top_k,
        fuse_qkv=False,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=args.rope_config(HalfFrequencyRoPE),
    )
    for layer in layers:
        moe = layer.moe
        moe.router.route_norm = args.route_norm
        moe.router._debug_force_load_balance = args.force_load_balance
        moe.load_balance_coeff = args.load_balance_coeff
        experts = moe.routed_experts.inner_experts
        moe.routed_experts.inner_experts = RecomputedGroupedExperts.Config(
            **{f.name: getattr(experts, f.name) for f in dataclasses.fields(experts)}
        )
    return decoder_config(args, with_block_class(layers, Qwen3Block))


class Qwen3Moe(Decoder030, Qwen3Model):
    """torchtitan's ``Qwen3Model`` of ``Qwen3MoeArgs``, with the long-context forward
    (``models.long_context``)."""

    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__(model_config(args))
        self.model_args = args


_SUPPORTED = SUPPORTED | {"decoder_sparse_step": 1, "mlp_only_layers": []}
"""config.json fields and the only value our Qwen3-MoE implements (every block a MoE block)."""
_READS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size")
_SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "vocab_size",
)


def args_from_hf(config: dict[str, Any], source: str) -> Qwen3MoeArgs:
    """The ``Qwen3MoeArgs`` of a Hugging Face Qwen3-MoE ``config.json``. Its number of experts
    is ``num_experts`` as the published checkpoints write it, ``num_local_experts`` as
    transformers 5 does. ``router_aux_loss_coef`` is transformers' training loss, which this
    project replaces with torchtitan's auxiliary-loss-free balancing; the model's numbers do not
    depend on it."""
    check_supported(config, _SUPPORTED, source, reads=_READS)
    require(config, _SHAPE_KEYS, source, "Qwen3-MoE")
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if not num_experts:
        raise ValueError(f"{source}: no num_experts; is this a Qwen3-MoE config.json?")
    return Qwen3MoeArgs(
        **decoder_fields(config, source, "Qwen3-MoE"),
        ffn_dim=config["moe_intermediate_size"],
        num_experts=int(num_experts),
        top_k=config["num_experts_per_tok"],
        route_norm=bool(config.get("norm_topk_prob", False)),
    )


def hf_adapter(args: Qwen3MoeArgs, hf_assets_path: str | None) -> Qwen3StateDictAdapter:
    """torchtitan's state-dict adapter (experts split to and stacked from Hugging Face's
    per-expert ``mlp.experts.{e}.*_proj``) for ``args``."""
    return Qwen3StateDictAdapter(model_config(args), hf_assets_path)


ARGS_CLASS = Qwen3MoeArgs
MODEL_CLASS = Qwen3Moe


def hf_extra_fields(args: Qwen3MoeArgs) -> dict[str, Any]:
    """The config.json fields of the experts (``models.hf_config.shape_fields``):
    ``intermediate_size`` is the dense MLP's, which no block of ours has."""
    return {
        "moe_intermediate_size": args.resolved_ffn_dim,
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": args.route_norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def hf_export_note(model: nn.Module) -> str:
    """What a Hugging Face export of ``model`` leaves out that changes its numbers: the expert
    biases of torchtitan's load balancing, which move each token's choice of experts and have no
    place in ``Qwen3MoeForCausalLM`` (it routes by the router's scores alone); "" when they are
    all zero (no balancing step has run)."""
    biases = [m.expert_bias_E for m in model.modules() if isinstance(m, MoE)]
    biases = [bias for bias in biases if bias is not None]
    largest = max((float(b.abs().max()) for b in biases), default=0.0)
    if largest == 0:
        return ""
    return (
        f"the experts' load-balancing biases (largest {largest:.3g}) are not part of "
        "Qwen3MoeForCausalLM: the exported model picks experts by the router's scores alone, "
        "so some tokens may take other experts than they do here"
    )
