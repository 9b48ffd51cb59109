"""How the context-parallel styles read torchtitan 0.3.0's ``GQAttention`` (Llama3's and Qwen3's
attention: ``parallel.attention_interface``).

A 0.3.0 module is built from parts: ``qkv_linear`` (separate ``wq``/``wk``/``wv``, or one fused
``wqkv`` whose rows are grouped by KV head), ``wo``, ``rope``, optional ``q_norm``/``k_norm``, and
is called as ``forward(x, attention_masks, positions)``. Its ``rope`` part tells the family: a
``ComplexRoPE`` rotates interleaved pairs (Llama3), a ``CosSinRoPE`` the halves' pairs (Qwen3),
and holds either torchtitan's position table or, in our models, the float64 inverse frequencies
(``models.tt030.FrequencyRoPE``). Our models' blocks hand the attention this shard's RoPE table,
computed once per forward, by name (``rope``); 0.3.0's own blocks have no such argument.
"""

from __future__ import annotations

import functools

from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE

from upipe_dtensor.kernels.rope import complex_table_rows, cos_sin_table_rows, rope_table
from upipe_dtensor.models.tt030 import FrequencyRoPE
from upipe_dtensor.parallel.attention_interface import (
    AttentionAdapter,
    AttentionCall,
    AttentionLayer,
    FusedQKV,
    ModuleWeights,
    norm_epsilon,
)
from upipe_dtensor.parallel.tensor_parallel import attention_plan

_PARTS = ("qkv_linear", "wo", "rope", "n_heads", "n_kv_heads", "head_dim")


class GQAttentionAdapter(AttentionAdapter):
    """torchtitan 0.3.0's ``GQAttention``, for both families that build it."""

    def check(self, module: nn.Module) -> None:
        missing = [part for part in _PARTS if not hasattr(module, part)]
        if missing:
            raise ValueError(
                "context-parallel attention styles apply to attention modules with qkv_linear "
                f"(separate or fused), wo and rope parts; {type(module).__name__} lacks "
                f"{missing}. Check the plan's module path (e.g. 'layers.*.attention')."
            )
        if not isinstance(module.rope, ComplexRoPE | CosSinRoPE):
            raise ValueError(
                f"{type(module.rope).__name__} is neither torchtitan's ComplexRoPE (interleaved "
                "pairs) nor CosSinRoPE (rotate-half pairs), the RoPE the context-parallel styles "
                "compute"
            )

    def layer(self, module: nn.Module) -> AttentionLayer:
        interleaved = isinstance(module.rope, ComplexRoPE)
        q_norm = module.q_norm
        return AttentionLayer(
            family="llama3" if interleaved else "qwen3",
            n_heads=module.n_heads,
            n_kv_heads=module.n_kv_heads,
            head_dim=module.head_dim,
            scale=module.head_dim**-0.5,
            rope_pairs="interleaved" if interleaved else "half",
            qk_transform="" if q_norm is None else "rms_norm",
            qk_eps=0.0 if q_norm is None else norm_epsilon(q_norm),
        )

    def weights(self, module: nn.Module) -> ModuleWeights:
        qkv = module.qkv_linear
        if hasattr(qkv, "wqkv"):
            projections = FusedQKV(qkv.wqkv.weight, qkv.heads_per_kv)
        else:
            projections = (qkv.wq.weight, qkv.wk.weight, qkv.wv.weight)
        norms = () if module.q_norm is None else (module.q_norm.weight, module.k_norm.weight)
        return ModuleWeights(projections, module.wo.weight, *norms)

    def call(
        self,
        module: nn.Module,
        x: Tensor,
        attention_masks: Tensor | None = None,
        positions: Tensor | None = None,
        *,
        rope: Tensor | None = None,
    ) -> AttentionCall:
        if rope is not None:
            return AttentionCall(x, attention_masks, rope_table=rope, positions=positions)
        part = module.rope
        cache = part.cache  # under torchtitan's own tensor parallelism, replicated over tp
        cache = cache.to_local() if isinstance(cache, DTensor) else cache
        if isinstance(part, FrequencyRoPE):  # our models' inverse frequencies
            rule, reach = rope_table, None
        else:  # torchtitan's position table
            rule = complex_table_rows if isinstance(part, ComplexRoPE) else cos_sin_table_rows
            reach = cache.shape[0]
        return AttentionCall(
            x,
            attention_masks,
            positions=positions,
            rope_at=functools.partial(rule, cache),
            rope_positions=reach,
        )

    def tensor_parallel_plan(self, module: nn.Module) -> dict[str, ParallelStyle]:
        fused = hasattr(module.qkv_linear, "wqkv")
        names = ("wqkv",) if fused else ("wq", "wk", "wv")
        norms = () if module.q_norm is None else ("q_norm", "k_norm")
        return attention_plan(tuple(f"qkv_linear.{n}" for n in names), "wo", norms)


GQA_ADAPTER = GQAttentionAdapter()
