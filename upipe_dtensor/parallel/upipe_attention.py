"""UPipe: Ulysses context-parallel attention executed a few heads at a time.

Input is this rank's contiguous sequence shard ``x`` (B, S/C, D) of the attention block's
(normalised) input; output is the pre-``wo`` attention output (B, S/C, H*d) in the model's own head
order, so ``wo`` and pretrained checkpoints apply unchanged. For each stage of U query heads
(U a multiple of the CP degree C; U = H is classic Ulysses):

    q   = rope(x @ wq[stage heads].T)                 (B, S/C, U, d)   local sequence, U heads
    q_h = all_to_all(q)                               (B, S,   U/C, d) whole sequence, own heads
    o_h, lse = causal_attention(q_h, k_h, v_h)        k_h, v_h from the stage's KV block
    out[:, :, stage heads] = all_to_all(o_h)          (B, S/C, U, d)   written into one buffer

K and V are projected, rotated and exchanged once per KV block (the KV heads that the block's
stages need) and reused by every stage of that block. With fewer KV heads than ranks, K/V are
repeated in activation space before the exchange and their gradients summed back afterwards.

Memory bound (per rank, activations, bytes b per element, N = B*S/C tokens, u = U/C):
  forward : the output buffer N*H*d*b  +  one stage's Q, attention output and their all-to-all
            buffers, each N*U*d*b (~4 live at once)  +  one KV block's K, V (local and exchanged,
            N*C*k*d*b each, k = KV heads per rank)  +  the LSEs, H/C * B*S floats in total.
  saved   : x, the output buffer (which ``wo`` saves anyway), the LSEs and the RoPE rows of the
            shard (N*d*4). Q/K/V are never kept.
  backward: recomputes each stage's Q (and each block's K/V) from x, exchanges the stage's slices
            of the output and its gradient, and holds one stage's worth of those plus dx, the
            weight gradients and the block's float32 dK/dV accumulators (2 * N*C*k*d*4).
  weights : a stage whose heads are not contiguous gathers its U*d rows of wq (U*d*D elements;
            independent of the sequence length, so negligible at long context).
  kernels : the CUDA SDPA backend repeats K/V to the U/C query heads of a stage; the CPU kernel
            and flash-attn take grouped K/V as they are.
Classic Ulysses (U = H) holds all of Q and the attention output in both layouts at once; UPipe
with U = C holds C/H of that. ``benchmarks/attention_memory.py`` measures it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from ..kernels.attention import attention_backward, attention_forward, resolve_backend
from ..kernels.op_mode import OpSpec, call
from ..kernels.rope import apply_rope, apply_rope_transpose
from .all_to_all import heads_to_sequence, sequence_to_heads, _group
from .head_schedule import HeadSchedule, Stage, make_head_schedule


@functools.lru_cache(maxsize=None)
def _head_index(heads: tuple[int, ...], device: torch.device) -> Tensor:
    """A stage's head indices on ``device``, built once: a fresh host-to-GPU copy per stage
    would stall the CPU until the stream catches up."""
    return torch.tensor(heads, device=device)


class _Layer:
    """The per-call constants of one UPipe layer: schedule, group, shapes and weight views."""

    def __init__(
        self,
        x: Tensor,
        wq: Tensor,
        wk: Tensor,
        wv: Tensor,
        group_name: str,
        cp_size: int,
        head_dim: int,
        heads_per_stage: int,
        backend: str,
    ) -> None:
        self.batch, self.local_len, self.dim = x.shape
        self.head_dim = head_dim
        self.schedule: HeadSchedule = make_head_schedule(
            wq.shape[0] // head_dim, wk.shape[0] // head_dim, cp_size, heads_per_stage
        )
        self.cp_size = cp_size
        self.group: dist.ProcessGroup | None = _group(group_name) if cp_size > 1 else None
        if self.group is not None and self.group.size() != cp_size:
            raise ValueError(
                f"process group {group_name!r} has {self.group.size()} ranks, expected {cp_size}"
            )
        self.backend = resolve_backend(backend, x.device)
        # Weights as (heads, head_dim, dim): a stage picks whole heads.
        self.wq = wq.view(-1, head_dim, self.dim)
        self.wk = wk.view(-1, head_dim, self.dim)
        self.wv = wv.view(-1, head_dim, self.dim)
        self.x_flat = x.reshape(-1, self.dim)

    def stage_rows(self, weight: Tensor, stage: Stage) -> Tensor:
        """The stage's query-head rows of ``weight`` (U*d, D): a view when they are contiguous."""
        first = stage.first_head_if_contiguous
        heads = len(stage.query_heads)
        if first is not None:
            return weight[first : first + heads].reshape(-1, self.dim)
        index = _head_index(stage.query_heads, weight.device)
        return weight.index_select(0, index).reshape(-1, self.dim)

    def block_rows(self, weight: Tensor, block: int) -> Tensor:
        start, stop = self.schedule.kv_block_heads(block)
        return weight[start:stop].reshape(-1, self.dim)

    def project(self, rows: Tensor) -> Tensor:
        """x @ rows.T as (B, S/C, heads, d)."""
        return (self.x_flat @ rows.t()).view(self.batch, self.local_len, -1, self.head_dim)

    def to_heads(self, t: Tensor) -> Tensor:
        return sequence_to_heads(t, self.group, self.cp_size)

    def to_sequence(self, t: Tensor) -> Tensor:
        return heads_to_sequence(t, self.group, self.cp_size)

    def kv_for_block(self, block: int, rope: Tensor) -> tuple[Tensor, Tensor]:
        """K (rotated) and V of one KV block, replicated if needed, in the head layout."""
        rep = self.schedule.kv_replication
        k = apply_rope(self.project(self.block_rows(self.wk, block)), rope)
        v = self.project(self.block_rows(self.wv, block))
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        return self.to_heads(k), self.to_heads(v)

    def query_for_stage(self, stage: Stage, rope: Tensor) -> Tensor:
        return self.to_heads(apply_rope(self.project(self.stage_rows(self.wq, stage)), rope))

    def write_stage(self, buffer: Tensor, stage: Stage, values: Tensor) -> None:
        """buffer[:, :, stage heads] = values, for (B, S/C, H, d) buffers."""
        first = stage.first_head_if_contiguous
        if first is not None:
            buffer[:, :, first : first + values.shape[2]] = values
        else:
            buffer.index_copy_(2, _head_index(stage.query_heads, buffer.device), values)

    def write_weight_grad(self, grad_w: Tensor, stage: Stage, grad_proj: Tensor) -> None:
        """grad_w[stage heads] = grad_proj.T @ x, in place when the heads are contiguous."""
        first = stage.first_head_if_contiguous
        if first is not None:
            rows = grad_w[first : first + len(stage.query_heads)].view(-1, self.dim)
            torch.mm(grad_proj.t(), self.x_flat, out=rows)
        else:
            index = _head_index(stage.query_heads, grad_w.device)
            grad_w.index_copy_(0, index, (grad_proj.t() @ self.x_flat).view(-1, *grad_w.shape[1:]))

    def read_stage(self, buffer: Tensor, stage: Stage) -> Tensor:
        first = stage.first_head_if_contiguous
        if first is not None:
            return buffer[:, :, first : first + len(stage.query_heads)]
        return buffer.index_select(2, _head_index(stage.query_heads, buffer.device))


def upipe_forward(
    x: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    rope: Tensor,
    group_name: str,
    cp_size: int,
    head_dim: int,
    heads_per_stage: int,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """The stage loop; returns (out (B, S/C, H*d), lse (stages, B, U/C, S) float32)."""
    layer = _Layer(x, wq, wk, wv, group_name, cp_size, head_dim, heads_per_stage, backend)
    schedule = layer.schedule
    out = x.new_empty(layer.batch, layer.local_len, schedule.n_heads, head_dim)
    lse = x.new_empty(
        len(schedule.stages),
        layer.batch,
        schedule.query_heads_per_rank,
        layer.local_len * cp_size,
        dtype=torch.float32,
    )
    k_h = v_h = None
    for index, stage in enumerate(schedule.stages):
        if stage.opens_kv_block:
            k_h, v_h = layer.kv_for_block(stage.kv_block, rope)
        q_h = layer.query_for_stage(stage, rope)
        o_h, lse[index] = attention_forward(q_h, k_h, v_h, scale, layer.backend)
        del q_h
        if stage.closes_kv_block:
            k_h = v_h = None
        layer.write_stage(out, stage, layer.to_sequence(o_h))
        del o_h
    return out.view(layer.batch, layer.local_len, -1), lse


def upipe_backward(
    grad_out: Tensor,
    x: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    rope: Tensor,
    out: Tensor,
    lse: Tensor,
    group_name: str,
    cp_size: int,
    head_dim: int,
    heads_per_stage: int,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Stage-by-stage backward from x, the output and the LSEs; returns (dx, dwq, dwk, dwv)."""
    layer = _Layer(x, wq, wk, wv, group_name, cp_size, head_dim, heads_per_stage, backend)
    schedule = layer.schedule
    heads_shape = (layer.batch, layer.local_len, schedule.n_heads, head_dim)
    out, grad_out = out.view(heads_shape), grad_out.reshape(heads_shape)
    grad_x = torch.zeros_like(layer.x_flat)
    grad_wq, grad_wk, grad_wv = (torch.zeros_like(w) for w in (layer.wq, layer.wk, layer.wv))
    k_h = v_h = grad_k_h = grad_v_h = None

    for index, stage in enumerate(schedule.stages):
        if stage.opens_kv_block:
            k_h, v_h = layer.kv_for_block(stage.kv_block, rope)
            grad_k_h = torch.zeros_like(k_h, dtype=torch.float32)
            grad_v_h = torch.zeros_like(v_h, dtype=torch.float32)
        q_h = layer.query_for_stage(stage, rope)
        o_h = layer.to_heads(layer.read_stage(out, stage))
        grad_o_h = layer.to_heads(layer.read_stage(grad_out, stage))
        grad_q_h, grad_k_stage, grad_v_stage = attention_backward(
            grad_o_h, q_h, k_h, v_h, o_h, lse[index], scale, layer.backend
        )
        del q_h, o_h, grad_o_h
        grad_k_h += grad_k_stage
        grad_v_h += grad_v_stage
        del grad_k_stage, grad_v_stage

        grad_q = apply_rope_transpose(layer.to_sequence(grad_q_h), rope)
        del grad_q_h
        grad_q = grad_q.reshape(-1, layer.wq.shape[1] * len(stage.query_heads))
        grad_x.addmm_(grad_q, layer.stage_rows(layer.wq, stage))
        layer.write_weight_grad(grad_wq, stage, grad_q)
        del grad_q

        if stage.closes_kv_block:
            del k_h, v_h
            grad_k = apply_rope_transpose(_kv_grad(layer, grad_k_h), rope)
            grad_v = _kv_grad(layer, grad_v_h)
            del grad_k_h, grad_v_h
            start, stop = schedule.kv_block_heads(stage.kv_block)
            for grad, weight, grad_weight in ((grad_k, layer.wk, grad_wk), (grad_v, layer.wv, grad_wv)):
                grad = grad.reshape(-1, (stop - start) * head_dim)
                grad_x.addmm_(grad, weight[start:stop].reshape(-1, layer.dim))
                torch.mm(grad.t(), layer.x_flat, out=grad_weight[start:stop].view(-1, layer.dim))
            del grad_k, grad_v
            k_h = v_h = grad_k_h = grad_v_h = None

    return (
        grad_x.view_as(x),
        grad_wq.view_as(wq),
        grad_wk.view_as(wk),
        grad_wv.view_as(wv),
    )


def _kv_grad(layer: _Layer, grad_h: Tensor) -> Tensor:
    """A KV block's float32 gradient in the head layout -> model KV heads on the local shard."""
    grad = layer.to_sequence(grad_h.to(layer.x_flat.dtype))
    rep = layer.schedule.kv_replication
    if rep > 1:  # replicas of one KV head each got part of the gradient: sum them
        grad = grad.unflatten(2, (-1, rep)).sum(3)
    return grad


# --- registration: one opaque op pair, so torch.compile sees a single node per layer ---------


@torch.library.custom_op("upipe::attention_fwd", mutates_args=())
def _attention_fwd(
    x: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    rope: Tensor,
    group_name: str,
    cp_size: int,
    head_dim: int,
    heads_per_stage: int,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor]:
    return upipe_forward(
        x, wq, wk, wv, rope, group_name, cp_size, head_dim, heads_per_stage, scale, backend
    )


@_attention_fwd.register_fake
def _(x, wq, wk, wv, rope, group_name, cp_size, head_dim, heads_per_stage, scale, backend):
    batch, local_len, _ = x.shape
    n_stages = wq.shape[0] // head_dim // heads_per_stage
    out = x.new_empty(batch, local_len, wq.shape[0])
    lse = x.new_empty(
        n_stages, batch, heads_per_stage // cp_size, local_len * cp_size, dtype=torch.float32
    )
    return out, lse


@torch.library.custom_op("upipe::attention_bwd", mutates_args=())
def _attention_bwd(
    grad_out: Tensor,
    x: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    rope: Tensor,
    out: Tensor,
    lse: Tensor,
    group_name: str,
    cp_size: int,
    head_dim: int,
    heads_per_stage: int,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return upipe_backward(
        grad_out, x, wq, wk, wv, rope, out, lse,
        group_name, cp_size, head_dim, heads_per_stage, scale, backend,
    )


@_attention_bwd.register_fake
def _(grad_out, x, wq, wk, wv, rope, out, lse, *args):
    return torch.empty_like(x), torch.empty_like(wq), torch.empty_like(wk), torch.empty_like(wv)


_CONSTANTS = ("group_name", "cp_size", "head_dim", "heads_per_stage", "scale", "backend")


def _setup_context(ctx, inputs, output) -> None:
    x, wq, wk, wv, rope, *constants = inputs
    out, lse = output
    ctx.save_for_backward(x, wq, wk, wv, rope, out, lse)
    ctx.constants = constants


def _backward(ctx, grad_out: Tensor, grad_lse: Tensor | None):
    x, wq, wk, wv, rope, out, lse = ctx.saved_tensors
    grad_x, grad_wq, grad_wk, grad_wv = call(
        _BACKWARD, grad_out, x, wq, wk, wv, rope, out, lse, *ctx.constants
    )
    return (grad_x, grad_wq, grad_wk, grad_wv) + (None,) * (1 + len(_CONSTANTS))


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
_FORWARD = OpSpec(_attention_fwd, upipe_forward, _setup_context, _backward)
_BACKWARD = OpSpec(_attention_bwd, upipe_backward)


def upipe_attention(
    x: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    rope: Tensor,
    *,
    group_name: str,
    cp_size: int,
    head_dim: int,
    heads_per_stage: int,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """Differentiable UPipe attention (pre-``wo`` output); see the module docstring.

    ``rope`` is the real RoPE table at this shard's global positions, (S/C, d/2, 2) or
    (B, S/C, d/2, 2), from ``kernels.rope.rope_table``.
    """
    out, _ = call(
        _FORWARD, x, wq, wk, wv, rope, group_name, cp_size, head_dim, heads_per_stage,
        head_dim**-0.5 if scale is None else scale, backend,
    )
    return out
