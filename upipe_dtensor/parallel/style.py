"""``UPipeAttention`` and ``UlyssesAttention``: context-parallel styles for Llama3 attention.

Applied with ``parallelize_module(model, cp_mesh, {"layers.*.attention": UPipeAttention()})`` to
torchtitan's Llama3 ``Attention``. Unlike PyTorch's tensor-parallel styles, the parameters stay
plain tensors, replicated over the CP mesh: the style changes how activations are laid out, not
how weights are, so ``fully_shard`` applied afterwards owns the parameters as usual.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn, Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from ..kernels.attention import BACKENDS
from ..kernels.rope import rope_table
from .head_schedule import make_head_schedule
from .layouts import contiguous_positions
from .upipe_attention import upipe_attention


@dataclass(frozen=True)
class _CPAttentionPlan:
    group_name: str
    cp_rank: int
    cp_size: int
    heads_per_stage: int
    backend: str
    style: "UPipeAttention"


class UPipeAttention(ParallelStyle):
    """Ulysses context parallelism run a few query heads at a time (UPipe, arXiv 2602.21196).

    The module's input is this rank's contiguous sequence shard ``[r*S/C, (r+1)*S/C)``, shape
    (B, S/C, D), and so is its output: only the attention in between sees the whole sequence, for
    ``heads_per_stage / C`` heads at a time. RoPE uses global positions: derived from the rank when
    ``positions`` is None, else the given (1, S/C) or (B, S/C) global indices. Outputs and
    gradients equal the unsharded model's (same weights, same GQA pairing), up to rounding.

    Keyword Args:
        heads_per_stage (int, optional): U, the query heads exchanged per stage, across all ranks.
            A multiple of the CP degree C that divides n_heads. ``None`` means U = C: one head per
            rank per stage, the smallest attention memory. U = n_heads is classic Ulysses.
        backend (str): local attention kernel: "auto" (flash-attn on CUDA if installed, else
            PyTorch SDPA), "flash" or "sdpa".

    Example::
        >>> from torch.distributed.tensor.parallel import parallelize_module
        >>> parallelize_module(model, cp_mesh, {"layers.*.attention": UPipeAttention()})
        >>> logits_shard = model(tokens[:, rank * s_local : (rank + 1) * s_local])
    """

    def __init__(self, *, heads_per_stage: int | None = None, backend: str = "auto") -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
        self.heads_per_stage = heads_per_stage
        self.backend = backend

    def shard_positions(self, seq_len: int, cp_rank: int, cp_size: int) -> Tensor:
        """The global token indices rank ``cp_rank`` of ``cp_size`` feeds, in the order the module
        expects: the contiguous slice ``[r*S/C, (r+1)*S/C)``."""
        return contiguous_positions(seq_len, cp_rank, cp_size)

    def _stage_size(self, n_heads: int, cp_size: int) -> int:
        return cp_size if self.heads_per_stage is None else self.heads_per_stage

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_attention_module(module)
        if device_mesh.ndim != 1:
            raise ValueError(
                f"{type(self).__name__} needs a 1-D context-parallel mesh, got "
                f"{device_mesh.ndim}-D {device_mesh.mesh_dim_names}; pass the cp dimension, "
                f"e.g. mesh['cp']"
            )
        cp_size = device_mesh.size()
        heads_per_stage = self._stage_size(module.n_heads, cp_size)
        make_head_schedule(module.n_heads, module.n_kv_heads, cp_size, heads_per_stage)
        plan = _CPAttentionPlan(
            group_name=device_mesh.get_group().group_name,
            cp_rank=device_mesh.get_local_rank(),
            cp_size=cp_size,
            heads_per_stage=heads_per_stage,
            backend=self.backend,
            style=self,
        )
        module.forward = functools.partial(_cp_attention_forward, module, plan)
        return module


class UlyssesAttention(UPipeAttention):
    """Classic DeepSpeed-Ulysses: every head in one stage (``UPipeAttention`` with U = n_heads).

    Same contract and code path as ``UPipeAttention``; kept as its own style so baselines and
    recipes name what they run.
    """

    def __init__(self, *, backend: str = "auto") -> None:
        super().__init__(backend=backend)

    def _stage_size(self, n_heads: int, cp_size: int) -> int:
        return n_heads


def _check_attention_module(module: nn.Module) -> None:
    missing = [a for a in ("wq", "wk", "wv", "wo", "n_heads", "n_kv_heads", "head_dim")
               if not hasattr(module, a)]
    if missing:
        raise ValueError(
            f"context-parallel attention styles apply to torchtitan Llama3 Attention modules; "
            f"{type(module).__name__} lacks {missing}. Check the plan's module path "
            f"(e.g. 'layers.*.attention')."
        )
    if getattr(module, "attn_type", "sdpa") != "sdpa":
        raise ValueError(
            f"attention with attn_type={module.attn_type!r} is not supported by UPipe, which runs "
            f"plain causal attention; build the model with attn_type='sdpa'"
        )
    for name in ("wq", "wk", "wv"):
        if isinstance(getattr(module, name).weight, DTensor):
            raise ValueError(
                f"{name}.weight is already a DTensor: apply the context-parallel style before "
                f"tensor parallelism or fully_shard"
            )
    if module.head_dim % 2:
        raise ValueError(f"head_dim={module.head_dim} must be even for rotary embeddings")


def _cp_attention_forward(
    module: nn.Module,
    plan: _CPAttentionPlan,
    x: Tensor,
    freqs_cis: Tensor,
    attention_masks: object | None = None,
    positions: Tensor | None = None,
) -> Tensor:
    """Drop-in for torchtitan ``Attention.forward`` on a sequence shard."""
    if attention_masks is not None:
        raise ValueError("UPipe runs causal attention over the whole sequence; masks are not supported")
    local_len = x.shape[1]
    if positions is None:
        seq_len = local_len * plan.cp_size
        if freqs_cis.is_complex() and seq_len > freqs_cis.shape[0]:  # a torchtitan position table
            raise ValueError(
                f"sequence length {seq_len} (= {local_len} local tokens x cp {plan.cp_size}) "
                f"exceeds the model's RoPE table of {freqs_cis.shape[0]} positions; build the "
                f"model with max_seq_len >= {seq_len}"
            )
        positions = plan.style.shard_positions(seq_len, plan.cp_rank, plan.cp_size).to(x.device)
    elif positions.shape[-1] != local_len or positions.dim() != 2:
        raise ValueError(
            f"positions must be (1, {local_len}) or (B, {local_len}) global indices of this "
            f"rank's shard, got shape {tuple(positions.shape)}"
        )
    elif positions.shape[0] == 1:
        positions = positions[0]
    out = upipe_attention(
        x,
        module.wq.weight,
        module.wk.weight,
        module.wv.weight,
        rope_table(freqs_cis, positions),
        group_name=plan.group_name,
        cp_size=plan.cp_size,
        head_dim=module.head_dim,
        heads_per_stage=plan.heads_per_stage,
        backend=plan.backend,
    )
    return module.wo(out)
