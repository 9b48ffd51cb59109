"""How the context-parallel styles read torchtitan 0.2.2's attention modules (Llama3's and
Qwen3's ``Attention``: ``parallel.attention_interface``).

A 0.2.2 module holds ``wq``, ``wk``, ``wv`` and ``wo`` (Qwen3 also ``q_norm`` and ``k_norm``) and
is called as ``forward(x, freqs_cis, attention_masks, positions)``: RoPE arrives under
torchtitan's name for it, ``freqs_cis``, in one of the forms 0.2.2's blocks pass there. Our
models pass this shard's table (``kernels.rope.rope_table``: float32 (..., S/C, head_dim/2, 2)),
computed once per forward, or their float64 inverse frequencies; torchtitan's own models their
position table (Llama3's complex one, Qwen3's real [cos, cos, sin, sin] ``rope_cache``). The form
tells which; the styles see only the table or the rule that computes it.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ParallelStyle

from upipe_dtensor.kernels.rope import (
    RopePairs,
    complex_table_rows,
    cos_sin_table_rows,
    rope_table,
)
from upipe_dtensor.parallel.attention_interface import (
    AttentionAdapter,
    AttentionCall,
    AttentionLayer,
    ModuleWeights,
    norm_epsilon,
)
from upipe_dtensor.parallel.tensor_parallel import attention_plan

_PARTS = ("wq", "wk", "wv", "wo", "n_heads", "n_kv_heads", "head_dim")


def _norms(module: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """Qwen3's per-head Q and K norms, when this module has them (built with ``qk_norm``)."""
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    return None if q_norm is None or k_norm is None else (q_norm, k_norm)


class Attention022(AttentionAdapter):
    """One family's 0.2.2 ``Attention``: its RoPE pairing and per-head Q/K transform (applied
    with the module's ``q_norm``/``k_norm`` when it has them)."""

    def __init__(self, family: str, rope_pairs: RopePairs, qk_transform: str = "") -> None:
        self.family, self.rope_pairs, self.qk_transform = family, rope_pairs, qk_transform

    def check(self, module: nn.Module) -> None:
        missing = [part for part in _PARTS if not hasattr(module, part)]
        if missing:
            raise ValueError(
                f"context-parallel attention styles apply to {self.family} attention modules with "
                f"wq/wk/wv/wo projections; {type(module).__name__} lacks {missing}. Check the "
                "plan's module path (e.g. 'layers.*.attention')."
            )
        if getattr(module, "attn_type", "sdpa") != "sdpa":
            raise ValueError(
                f"attention with attn_type={module.attn_type!r} is not supported: the "
                "context-parallel styles run their own attention (causal, or document-masked "
                "through attention_masks); build the model with attn_type='sdpa'"
            )

    def layer(self, module: nn.Module) -> AttentionLayer:
        norms = _norms(module) if self.qk_transform else None
        return AttentionLayer(
            family=self.family,
            n_heads=module.n_heads,
            n_kv_heads=module.n_kv_heads,
            head_dim=module.head_dim,
            scale=module.head_dim**-0.5,
            rope_pairs=self.rope_pairs,
            qk_transform=self.qk_transform if norms is not None else "",
            qk_eps=0.0 if norms is None else norm_epsilon(norms[0]),
        )

    def weights(self, module: nn.Module) -> ModuleWeights:
        norms = _norms(module) if self.qk_transform else None
        return ModuleWeights(
            (module.wq.weight, module.wk.weight, module.wv.weight),
            module.wo.weight,
            *((norms[0].weight, norms[1].weight) if norms is not None else ()),
        )

    def call(
        self,
        module: nn.Module,
        x: Tensor,
        freqs_cis: Tensor,
        attention_masks: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> AttentionCall:
        if freqs_cis.dtype == torch.float32 and freqs_cis.dim() in (3, 4):  # this shard's table
            return AttentionCall(x, attention_masks, rope_table=freqs_cis, positions=positions)
        if freqs_cis.dtype == torch.float64:  # our models' inverse frequencies
            rule, reach = rope_table, None
        else:  # torchtitan's position table
            rule = complex_table_rows if freqs_cis.is_complex() else cos_sin_table_rows
            reach = freqs_cis.shape[0]
        return AttentionCall(
            x,
            attention_masks,
            positions=positions,
            rope_at=functools.partial(rule, freqs_cis),
            rope_positions=reach,
        )

    def tensor_parallel_plan(self, module: nn.Module) -> dict[str, ParallelStyle]:
        norms = ("q_norm", "k_norm") if _norms(module) is not None else ()
        return attention_plan(("wq", "wk", "wv"), "wo", norms)
