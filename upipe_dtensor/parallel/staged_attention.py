"""Staged attention: Ulysses context parallelism executed a few heads at a time (UPipe), optionally
across a ring. One op for UPipe (U < H), Ulysses (U = H), 2D UPipe and ring attention (C_h = 1).

Input is this rank's sequence shard ``x`` (B, S/C, D) of the attention block's (normalised)
input; output is the layer's output ``out @ wo.T`` (B, S/C, D), where ``out`` is the attention
output in the model's own head order, so pretrained checkpoints apply unchanged. For each stage of
U query heads (U a multiple of the head-axis degree C_h; U = H is classic Ulysses):

    q   = rope(qk(x @ wq[stage heads].T))             (B, S/C, U, d)     local sequence, U heads
    q_h = all_to_all(q)                               (B, S/R, U/C_h, d) ring rank's tokens, own
    heads
    o_h, lse = attention(q_h, k_h, v_h)               k_h, v_h from the stage's KV block
    out[:, :, stage heads] = all_to_all(o_h)          (B, S/C, U, d)     written into one buffer

With ``overlap_stages`` the all-to-alls of stage s+1 fly (NCCL's stream, gloo's worker threads)
while stage s attends (``all_to_all.Exchange``). ``attention`` is one causal kernel call when
there is no ring axis (R = 1, C = C_h), and ring
attention across the R ranks of the ring axis otherwise (``parallel.ring``: 2D UPipe, or with
C_h = 1 and U = H plain ring attention). K and V are projected, rotated and exchanged once per KV
block (the KV heads that the block's stages need) and reused by every stage of that block. With
fewer KV heads than head-axis ranks, K/V are repeated in activation space before the exchange and
their gradients summed back afterwards. ``doc_ids`` (None, or (B, S) document ids of the whole
sequence) restricts attention to each token's own document.

Memory bound (per rank, activations, bytes b per element, N = B*S/C tokens, u = U/C_h):
  forward : the output buffer N*H*d*b and the layer output N*D*b  +  one stage's Q, attention
            output and their all-to-all buffers, each N*U*d*b (~4 live at once)  +  one KV
            block's K, V (local and exchanged, N*C_h*k*d*b each, k = KV heads per rank)  +  the
            LSEs, H/C_h * B*S/R floats in total; with a ring, also the next K/V block in flight
            and a float32 output accumulator of one stage (N*U*d*4).
  saved   : x, the output buffer, the LSEs and the RoPE rows of the shard (N*d*4). Q/K/V are
            never kept.
  backward: recomputes each stage's Q (and each block's K/V) from x, exchanges the stage's slices
            of the output and of its gradient (formed from the layer's output gradient and the
            stage's columns of wo, so the whole pre-wo gradient never exists), and holds one
            stage's worth of those, the weight gradients and the block's dK/dV: float32 sums over
            the block's stages (2 * N*C_h*k*d*4), or the kernel's own with one stage per block
            (Ulysses, ring); a ring adds the travelling K/V and dK/dV of one block and a float32
            dQ of one stage. On CUDA flash-attn adds a float32 dQ workspace of the stage
            (``kernels.attention.cuda_backward_workspace_bytes``). Each stage's dQ, back in the
            sequence layout, waits in the saved output buffer (its stage's slice was read first;
            under activation checkpointing nothing else reads it, otherwise a new buffer of N*H*d*b
            is taken). dx (N*D*b; float32 beyond two KV blocks, ``new_input_grad``) is created
            when the first KV block closes and dwq after the last stage, each one product over all
            query heads: while the stages run no dx is held (planner, Llama3-8B at 3M on 8 GPUs,
            FA3, stages in turn: 48.0 GiB per GPU, where a float32 dx summed across the stages
            planned 54.3). Only when that buffer would be new and dx exists while the stages
            run anyway (more than one KV block, e.g. MHA at U = C_h, no checkpointing) and dx
            and dwq take fewer bytes than dx and the buffer (N >> D: long context) does each
            stage's dQ go into dx and dwq at once instead
            (``AttentionProjections.query_grads_wait``).
  weights : a stage whose heads are not contiguous gathers its U*d rows of wq and columns of wo
            (independent of the sequence length, so negligible at long context).
  overlap : with ``overlap_stages`` (the default) stage s+1's exchanges are started before stage
            s's attention and waited for just before their use, and stage s's results (its output
            in forward, its dQ in backward) come back during stage s+1's attention: one more
            stage's Q (and K/V at a block boundary) in both layouts in forward, its Q, output and
            output gradient in backward, plus the returning stage's buffers. The sums stay in
            stage order, so results are bitwise those of the stages in turn.
Classic Ulysses (U = H) holds all of Q and the attention output in both layouts at once; UPipe
with U = C_h holds C_h/H of that. ``benchmarks/attention_memory.py`` measures it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from upipe_dtensor.kernels.backends import op_kernel
from upipe_dtensor.kernels.merge import add_piece
from upipe_dtensor.parallel.all_to_all import Exchange
from upipe_dtensor.parallel.attention_op import AttentionOp, AttentionParams, AttentionWeights
from upipe_dtensor.parallel.head_schedule import Stage
from upipe_dtensor.parallel.projections import AttentionProjections, resolve_group
from upipe_dtensor.parallel.qk_transform import QKTransform
from upipe_dtensor.parallel.ring import Ring, ring_attention_backward, ring_attention_forward


class _Layer(AttentionProjections):
    """The projections of the whole local shard, plus the ring the stages attend across."""

    def __init__(
        self, x: Tensor, weights: AttentionWeights, params: AttentionParams, doc_ids: Tensor | None
    ) -> None:
        super().__init__(x, weights, params, QKTransform(weights, params))
        group = resolve_group(params.ring_group, params.ring_degree)
        self.ring = Ring(group, group.rank() if group is not None else 0, params.ring_degree)
        self.backend = op_kernel(
            params.backend, params.kernel_device, x, documents=doc_ids is not None
        )
        self.scale = params.scale


class _ForwardInputs:
    """A stage's exchanges into the head layout, started: its queries and, when the stage opens
    a KV block, the block's K and V."""

    def __init__(self, layer: _Layer, stage: Stage, rope: Tensor) -> None:
        self.kv = layer.start_kv_for_block(stage.kv_block, rope) if stage.opens_kv_block else None
        self.query = layer.start_query_for_stage(stage, rope)

    def result(self) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        kv = None if self.kv is None else (self.kv[0].result(), self.kv[1].result())
        return self.query.result(), kv


class _BackwardInputs(_ForwardInputs):
    """A stage's exchanges into the head layout for backward, started: the forward's, and its
    slices of the output and of the output's gradient."""

    def __init__(
        self, layer: _Layer, stage: Stage, rope: Tensor, out: Tensor, grad_y: Tensor, wo: Tensor
    ) -> None:
        super().__init__(layer, stage, rope)
        self.out = layer.start_to_heads(layer.read_stage(out, stage))
        self.grad_out = layer.start_output_grad(grad_y, wo, stage)

    def result(self) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor] | None]:
        query, kv = super().result()
        return query, self.out.result(), self.grad_out.result(), kv


def _next(
    stages: tuple[Stage, ...], order: list[int] | range, position: int, overlap: bool
) -> Stage | None:
    """The stage whose exchanges start during the attention of the stage at ``position`` of
    ``order`` (``AttentionProjections.stage_order``; None: not yet)."""
    return stages[order[position + 1]] if overlap and position + 1 < len(order) else None


def staged_forward(
    x: Tensor,
    weights: AttentionWeights,
    rope: Tensor,
    doc_ids: Tensor | None,
    params: AttentionParams,
) -> tuple[Tensor, Tensor, Tensor]:
    """The stage loop; returns (y = out @ wo.T (B, S/C, D), out (B, S/C, H*d),
    lse (stages, B, U/C_h, S/R) float32)."""
    layer = _Layer(x, weights, params, doc_ids)
    stages = layer.schedule.stages
    out = x.new_empty(layer.batch, layer.local_len, layer.schedule.n_heads, params.head_dim)
    lse = x.new_empty(
        len(stages),
        layer.batch,
        layer.schedule.query_heads_per_rank,
        layer.local_len * params.head_degree,
        dtype=torch.float32,
    )
    k_h = v_h = None
    started: _ForwardInputs | None = None
    returning: tuple[Stage, Exchange] | None = None  # the previous stage's output, on its way
    order = layer.stage_order()
    for position, index in enumerate(order):
        stage = stages[index]
        q_h, kv = (started or _ForwardInputs(layer, stage, rope)).result()
        if kv is not None:
            k_h, v_h = kv
        following = _next(stages, order, position, params.overlap_stages)
        started = None if following is None else _ForwardInputs(layer, following, rope)
        o_h, lse[index] = ring_attention_forward(
            q_h, k_h, v_h, layer.scale, layer.backend, layer.ring, doc_ids
        )
        del q_h
        if stage.closes_kv_block:
            k_h = v_h = None
        if returning is not None:
            layer.write_stage(out, returning[0], returning[1].result())
        returning = (stage, layer.start_to_sequence(o_h))
        del o_h
        if not params.overlap_stages:
            layer.write_stage(out, returning[0], returning[1].result())
            returning = None
    if returning is not None:
        layer.write_stage(out, returning[0], returning[1].result())
    out = out.view(layer.batch, layer.local_len, -1)
    return out @ weights.wo.t(), out, lse


def staged_backward(
    grad_y: Tensor,
    x: Tensor,
    weights: AttentionWeights,
    rope: Tensor,
    doc_ids: Tensor | None,
    out: Tensor,
    lse: Tensor,
    params: AttentionParams,
) -> tuple[Tensor, AttentionWeights]:
    """Stage-by-stage backward from x, the output and the LSEs; returns (dx, the weights'
    gradients).

    Each stage's dQ, back in the sequence layout, waits in its heads of a (B, S/C, H, d) buffer:
    the saved output itself when it is scratch (``AttentionParams.output_is_scratch``; a stage's
    slice of it is read before its dQ is written there). dx is created when the first KV block
    closes, and dx += dQ @ wq and dwq = dQ.T @ x are one product each after the last stage, so
    no dx is held while the stages run. When the buffer would be new and dx exists while the
    stages run anyway (more than one KV block), each stage's dQ goes into dx and dwq at once
    instead if that holds less (``projections.AttentionProjections.query_grads_wait``; at long
    context it does). A KV block's dK, dV are
    summed over its stages in float32 (``merge.add_piece``; a block of one stage keeps the
    kernel's own). The sums are in stage order whether or not the stages overlap."""
    layer = _Layer(x, weights, params, doc_ids)
    wo = weights.wo
    stages = layer.schedule.stages
    per_block = layer.schedule.stages_per_kv_block
    grad_wo = grad_y.reshape(-1, grad_y.shape[-1]).t() @ out.reshape(-1, out.shape[-1])
    out = out.view(layer.batch, layer.local_len, layer.schedule.n_heads, params.head_dim)
    wait = layer.query_grads_wait(x, params.output_is_scratch)
    # Waiting, dx is created when the first KV block closes and dwq after the last stage.
    grads_q = (out if params.output_is_scratch else torch.empty_like(out)) if wait else None
    grad_x = None if wait else layer.new_input_grad(x, wait)
    grad_wq = None if wait else layer.new_query_weight_grad(chunks=1)
    grad_wk, grad_wv = (torch.zeros_like(w) for w in (layer.wk, layer.wv))
    k_h = v_h = grad_k_h = grad_v_h = None
    started: _BackwardInputs | None = None
    returning: tuple[Stage, Exchange] | None = None  # the previous stage's dQ, on its way

    def finish_query() -> None:
        nonlocal returning
        if returning is not None:
            layer.store_query_grad(returning[1], returning[0], rope, grads_q, grad_x, grad_wq)
            returning = None

    order = layer.stage_order()
    for position, index in enumerate(order):
        stage = stages[index]
        inputs = started or _BackwardInputs(layer, stage, rope, out, grad_y, wo)
        q_h, o_h, grad_o_h, kv = inputs.result()
        if kv is not None:
            k_h, v_h = kv
        following = _next(stages, order, position, params.overlap_stages)
        started = (
            None if following is None else _BackwardInputs(layer, following, rope, out, grad_y, wo)
        )
        grad_q_h, grad_k_stage, grad_v_stage = ring_attention_backward(
            grad_o_h,
            q_h,
            k_h,
            v_h,
            o_h,
            lse[index],
            layer.scale,
            layer.backend,
            layer.ring,
            doc_ids,
        )
        del q_h, o_h, grad_o_h
        grad_k_h = add_piece(grad_k_h, grad_k_stage, per_block)
        grad_v_h = add_piece(grad_v_h, grad_v_stage, per_block)
        del grad_k_stage, grad_v_stage

        sent = layer.start_to_sequence(grad_q_h)
        del grad_q_h
        finish_query()
        returning = (stage, sent)
        if not params.overlap_stages or stage.closes_kv_block:
            finish_query()

        if stage.closes_kv_block:
            del k_h, v_h
            if grad_x is None:
                grad_x = layer.new_input_grad(x, wait)
            layer.kv_backward(grad_k_h, grad_v_h, stage.kv_block, rope, grad_x, grad_wk, grad_wv)
            k_h = v_h = grad_k_h = grad_v_h = None

    if wait:
        grad_wq = layer.queries_backward(grads_q, grad_x)
    return grad_x.to(x.dtype), AttentionWeights(
        grad_wq.view_as(weights.wq),
        grad_wk.view_as(weights.wk),
        grad_wv.view_as(weights.wv),
        grad_wo,
        *layer.qk.weight_grads(),
    )


_OP = AttentionOp("attention", staged_forward, staged_backward)


def staged_attention(
    x: Tensor,
    weights: AttentionWeights,
    rope: Tensor,
    doc_ids: Tensor | None,
    params: AttentionParams,
) -> Tensor:
    """Differentiable staged attention including the output projection ``weights.wo``; see the
    module docstring. Returns the layer output (B, S/C, D).

    ``rope`` is the real RoPE table at this shard's global positions, (S/C, d/2, 2) or
    (B, S/C, d/2, 2), from ``kernels.rope.rope_table``. ``params.head_degree`` is the head-axis
    degree C_h; ``params.ring_degree`` R > 1 adds a ring axis across which each stage's attention
    runs as ring attention (2D UPipe; with C_h = 1 and U = H, plain ring attention).
    """
    return _OP(x, weights, rope, doc_ids, params)
