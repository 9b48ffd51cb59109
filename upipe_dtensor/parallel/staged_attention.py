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
            (``kernels.traced_workspace.cuda_backward_workspace_bytes``). Each stage's dQ, back
            in the sequence layout, waits in the saved output buffer (its stage's slice was read
            first; under activation checkpointing nothing else reads it, otherwise a new buffer of
            N*H*d*b is taken). dx (N*D*b; float32 beyond two KV blocks, ``new_input_grad``) is
            created when the first KV block closes and dwq after the last stage, each one product
            over all query heads: while the stages run no dx is held (planner, Llama3-8B at 3M on 8
            GPUs, FA3, stages in turn: 48.0 GiB per GPU, where a float32 dx summed across the stages
            planned 54.3). Only when that buffer would be new and dx exists while the stages run
            anyway (more than one KV block, e.g. MHA at U = C_h, no checkpointing) and dx and dwq
            take fewer bytes than dx and the buffer (N >> D: long context) does each stage's dQ go
            into dx and dwq at once instead (``AttentionProjections.query_grads_wait``).
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

The module reads top to bottom: the stage loop, forward and backward (``forward_stages``,
``backward_stages``, shared by the fused op and the op-level entry); the fused op's projections
(``AttentionProjections``: a stage's queries and a KV block's keys and values projected from a
span of the local shard, through the family's QK transform and RoPE, and in backward the
products of their gradients into dx and the weights' gradients, in the order that holds the
fewest bytes: ``query_grads_wait``, ``kv_grads_wait``); the fused op (``staged_forward``,
``staged_backward``, and where backward's gradients go: ``LayerGradients``); the op-level entry on
given q, k, v. FPDT (``fpdt_attention``) projects each of its sequence chunks with
``AttentionProjections`` and shares ``LayerGradients``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from upipe_dtensor.kernels.attention import attention_backward, attention_forward
from upipe_dtensor.kernels.backends import op_kernel
from upipe_dtensor.kernels.merge import accumulation_dtype, accumulator, add_piece
from upipe_dtensor.kernels.rope import apply_rope_, apply_rope_transpose_
from upipe_dtensor.parallel.all_to_all import Exchange, start_heads_to_sequence
from upipe_dtensor.parallel.attention_op import (
    AttentionOp,
    AttentionParams,
    AttentionWeights,
    QKVAttentionOp,
)
from upipe_dtensor.parallel.head_schedule import Stage
from upipe_dtensor.parallel.head_stages import GivenQKV, HeadStages, head_index, resolve_group
from upipe_dtensor.parallel.qk_transform import QKTransform
from upipe_dtensor.parallel.ring import Ring, ring_attention_backward, ring_attention_forward

# --- the stage loop --------------------------------------------------------------------------


class _Attention:
    """A stage's attention in one call, ``attend(q_h, k_h, v_h) -> (o_h, lse)`` and
    ``attend_backward(grad_o_h, q_h, k_h, v_h, o_h, lse) -> (dq, dk, dv)``: the causal kernel
    itself without a ring axis (R = 1), ring attention across the R ranks of the ring axis
    otherwise (``parallel.ring``). Bound once here, so the stage loops call the kernel directly."""

    attend: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    attend_backward: Callable[..., tuple[Tensor, Tensor, Tensor]]

    def _attend_with(self, params: AttentionParams, like: Tensor, doc_ids: Tensor | None) -> None:
        documents = doc_ids is not None
        kernel = op_kernel(params.backend, params.kernel_device, like, documents=documents)
        if params.ring_degree == 1:
            masks = {"causal": True, "q_docs": doc_ids, "k_docs": doc_ids}
            self.attend = functools.partial(
                attention_forward, scale=params.scale, kernel=kernel, **masks
            )
            self.attend_backward = functools.partial(
                attention_backward, scale=params.scale, kernel=kernel, **masks
            )
            return
        group = resolve_group(params.ring_group, params.ring_degree)
        ring = Ring(group, group.rank(), params.ring_degree)
        along = {"scale": params.scale, "backend": kernel, "ring": ring, "doc_ids": doc_ids}
        self.attend = functools.partial(ring_attention_forward, **along)
        self.attend_backward = functools.partial(ring_attention_backward, **along)


class _ForwardInputs:
    """A stage's exchanges into the head layout: its queries and, when the stage opens a KV
    block, the block's K and V. Started together, to fly during the previous stage's attention
    (``overlap``), or each one waited for before the next is projected, so only one send
    buffer exists at a time."""

    def __init__(self, layer: HeadStages, stage: Stage, rope: Tensor | None, overlap: bool) -> None:
        self.overlap = overlap
        self.kv = None
        if stage.opens_kv_block:
            self.kv = (
                self._started(layer.start_key_for_block(stage.kv_block, rope)),
                self._started(layer.start_value_for_block(stage.kv_block)),
            )
        self.query = self._started(layer.start_query_for_stage(stage, rope))

    def _started(self, exchange: Exchange) -> Exchange:
        return exchange if self.overlap else Exchange.done(exchange.result())

    def result(self) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        kv = None if self.kv is None else (self.kv[0].result(), self.kv[1].result())
        return self.query.result(), kv


OutputGrad = Callable[[Stage], Tensor]
"""A stage's slice (B, L, U, d) of the gradient of the attention output, in the sequence
layout."""


class _BackwardInputs(_ForwardInputs):
    """A stage's exchanges into the head layout for backward: the forward's, and its slices of
    the output and of the output's gradient (``output_grad``)."""

    def __init__(
        self,
        layer: HeadStages,
        stage: Stage,
        rope: Tensor | None,
        out: Tensor,
        output_grad: OutputGrad,
        overlap: bool,
    ) -> None:
        super().__init__(layer, stage, rope, overlap)
        read = functools.partial(layer.read_stage, out, stage)
        self.out = self._started(layer.start_to_heads(read))
        self.grad_out = self._started(layer.start_to_heads(functools.partial(output_grad, stage)))

    def result(self) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor] | None]:
        query, kv = super().result()
        return query, self.out.result(), self.grad_out.result(), kv


def _next(
    stages: tuple[Stage, ...], order: list[int] | range, position: int, overlap: bool
) -> Stage | None:
    """The stage whose exchanges start during the attention of the stage at ``position`` of
    ``order`` (``HeadStages.stage_order``; None: not yet)."""
    return stages[order[position + 1]] if overlap and position + 1 < len(order) else None


def forward_stages(
    layer: _Layer | _GivenLayer, rope: Tensor | None, overlap: bool
) -> tuple[Tensor, Tensor]:
    """The forward stage loop (the module docstring): (out (B, L, H, d), the attention output of
    every stage in the sequence layout and the model's head order; lse (stages, B, U/C_h, S_h)
    float32, each stage's in the head layout)."""
    stages = layer.schedule.stages
    like = layer.like
    out = like.new_empty(layer.batch, layer.local_len, layer.schedule.n_heads, layer.head_dim)
    lse = like.new_empty(
        len(stages),
        layer.batch,
        layer.schedule.query_heads_per_rank,
        layer.local_len * layer.head_degree,
        dtype=accumulation_dtype(like.dtype),
    )
    k_h = v_h = None
    started: _ForwardInputs | None = None
    returning: tuple[Stage, Exchange] | None = None  # the previous stage's output, on its way
    order = layer.stage_order()
    for position, index in enumerate(order):
        stage = stages[index]
        q_h, kv = (started or _ForwardInputs(layer, stage, rope, overlap)).result()
        if kv is not None:
            k_h, v_h = kv
        following = _next(stages, order, position, overlap)
        started = None if following is None else _ForwardInputs(layer, following, rope, overlap)
        o_h, lse[index] = layer.attend(q_h, k_h, v_h)
        del q_h
        if stage.closes_kv_block:
            k_h = v_h = None
        if returning is not None:
            layer.write_stage(out, returning[0], returning[1].result())
        returning = (stage, layer.start_to_sequence(o_h))
        del o_h
        if not overlap:
            layer.write_stage(out, returning[0], returning[1].result())
            returning = None
    if returning is not None:
        layer.write_stage(out, returning[0], returning[1].result())
    return out, lse


def backward_stages(
    layer: _Layer | _GivenLayer,
    grads: _Gradients | _InputGradients,
    rope: Tensor | None,
    out: Tensor,
    lse: Tensor,
    output_grad: OutputGrad,
    overlap: bool,
) -> None:
    """The backward stage loop (the module docstring), from ``out`` (B, L, H, d) and ``lse`` as
    ``forward_stages`` made them: each stage's dQ and each KV block's dK, dV go to ``grads``
    (where they go is theirs). The sums are in stage order whether or not the stages
    overlap."""
    stages = layer.schedule.stages
    per_block = layer.schedule.stages_per_kv_block
    k_h = v_h = None
    started: _BackwardInputs | None = None
    returning: tuple[Stage, Exchange] | None = None  # the previous stage's dQ, on its way

    def finish_query() -> None:
        nonlocal returning
        if returning is not None:
            grads.query(returning[1], returning[0], rope)
            returning = None

    order = layer.stage_order()
    for position, index in enumerate(order):
        stage = stages[index]
        inputs = started or _BackwardInputs(layer, stage, rope, out, output_grad, overlap)
        q_h, o_h, grad_o_h, kv = inputs.result()
        if kv is not None:
            k_h, v_h = kv
        following = _next(stages, order, position, overlap)
        started = (
            None
            if following is None
            else _BackwardInputs(layer, following, rope, out, output_grad, overlap)
        )
        grad_q_h, grad_k_stage, grad_v_stage = layer.attend_backward(
            grad_o_h, q_h, k_h, v_h, o_h, lse[index]
        )
        del q_h, o_h, grad_o_h
        grads.add_kv(grad_k_stage, grad_v_stage, per_block)
        del grad_k_stage, grad_v_stage

        sent = layer.start_to_sequence(grad_q_h) if grads.queries else None
        del grad_q_h
        if sent is not None:
            finish_query()
            returning = (stage, sent)
            if not overlap or stage.closes_kv_block:
                finish_query()

        if stage.closes_kv_block:
            k_h = v_h = None
            grads.close_block(stage.kv_block, rope)


# --- the fused op's projections: a stage's Q, a block's K and V, their gradients' products ---


UNSHARDED_DX_ROUNDINGS = 5
"""How often the unsharded model rounds an attention layer's dx in bf16: three products (through
wq, wk and wv) and the two sums of them (autograd adds the gradients of x's three uses)."""


def _add_product(target: Tensor, a: Tensor, b: Tensor) -> None:
    """target += a @ b, where ``target`` is (rows, D) or a (B, L, D) span of a larger buffer, in
    the operands' dtype or a float32 accumulator (``kernels.merge.accumulator``): in place when
    the span is contiguous (always with batch 1) and of the operands' dtype, else through one
    temporary, the product rounded once to the operands' dtype (as ``memory.tiled_mlp`` does)."""
    if target.is_contiguous() and target.dtype == a.dtype:
        target.view(-1, target.shape[-1]).addmm_(a, b)
    else:
        target.add_((a @ b).view_as(target))


def _nbytes(like: Tensor, summed: bool) -> int:
    """Bytes of ``kernels.merge.accumulator(like, summed=summed)``."""
    dtype = accumulation_dtype(like.dtype) if summed else like.dtype
    return like.numel() * dtype.itemsize


class AttentionProjections(HeadStages):
    """One layer's head stages over a span of the local sequence ``x`` (B, L, D), their queries,
    keys and values projected from it (each stage's rows of the weights; the fused attention
    ops): the span is the whole shard (UPipe, Ulysses, ring) or one sequence chunk of it (FPDT).
    Stages that are not contiguous gather their rows of ``wq`` (weights are small; activations
    never move). ``qk`` is the layer call's per-head transform of Q and K, shared by every span
    of the call."""

    def __init__(
        self, x: Tensor, weights: AttentionWeights, params: AttentionParams, qk: QKTransform
    ) -> None:
        wq, wk, wv = weights.wq, weights.wk, weights.wv
        head_dim = params.head_dim
        batch, local_len, self.dim = x.shape
        super().__init__(
            x,
            batch,
            local_len,
            wq.shape[0] // head_dim,
            wk.shape[0] // head_dim,
            head_dim,
            params.head_group,
            params.head_degree,
            params.heads_per_stage,
        )
        self.qk = qk
        self.rope_pairs = params.rope_pairs
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
        index = head_index(stage.query_heads, weight.device)
        return weight.index_select(0, index).reshape(-1, self.dim)

    def block_rows(self, weight: Tensor, block: int) -> Tensor:
        return weight[self.block_heads(block)].reshape(-1, self.dim)

    def project(self, rows: Tensor) -> Tensor:
        """x @ rows.T as (B, L, heads, d)."""
        return (self.x_flat @ rows.t()).view(self.batch, self.local_len, -1, self.head_dim)

    def query(self, stage: Stage, rope: Tensor) -> Tensor:
        """Q of one stage (B, L, U, d): projected, transformed and rotated."""
        q = self.qk.forward(self.project(self.stage_rows(self.wq, stage)), "q")
        return apply_rope_(q, rope, self.rope_pairs)

    def key(self, block: int, rope: Tensor) -> Tensor:
        """K of one KV block (B, L, heads, d): projected, transformed and rotated."""
        k = self.qk.forward(self.project(self.block_rows(self.wk, block)), "k")
        return apply_rope_(k, rope, self.rope_pairs)

    def value(self, block: int) -> Tensor:
        """V of one KV block (B, L, heads, d)."""
        return self.project(self.block_rows(self.wv, block))

    def stage_columns(self, wo: Tensor, stage: Stage) -> Tensor:
        """The stage's query-head columns of the output projection ``wo`` (D, U*d)."""
        heads = wo.view(wo.shape[0], -1, self.head_dim)
        first = stage.first_head_if_contiguous
        if first is not None:
            return heads[:, first : first + len(stage.query_heads)].reshape(wo.shape[0], -1)
        return heads.index_select(1, head_index(stage.query_heads, wo.device)).reshape(
            wo.shape[0], -1
        )

    def output_grad_slice(self, grad_y: Tensor, wo: Tensor, stage: Stage) -> Tensor:
        """The stage's slice of the gradient before ``wo``, (B, L, U, d): grad_y @ wo[:, stage
        columns]. The whole (tokens, H*d) gradient never exists."""
        grad = grad_y.reshape(-1, grad_y.shape[-1]) @ self.stage_columns(wo, stage)
        return grad.view(self.batch, self.local_len, -1, self.head_dim)

    def output_grad(self, grad_y: Tensor, wo: Tensor, stage: Stage) -> Tensor:
        """``output_grad_slice`` in the head layout."""
        return self.to_heads(functools.partial(self.output_grad_slice, grad_y, wo, stage))

    def query_grads_wait(self, x: Tensor, params: AttentionParams, chunks: int = 1) -> bool:
        """Whether the query gradients wait, each stage's in its heads of one (B, L, H, d)
        buffer, for one product into dx and dwq after the last stage (``queries_backward``),
        rather than go into dx and dwq as each stage's arrives (``store_query_grad``): the
        order that holds fewer bytes while the stages run, for the local shard ``x``.

        Waiting holds that buffer, free when the saved output is scratch
        (``AttentionParams.output_is_scratch``: under activation checkpointing, every
        long-context recipe), else N*H*d*b; and, with more than one KV block (or FPDT's chunks),
        what the closed blocks' K/V gradients go into while the stages run: dx, or where they
        hold less, the gradients themselves (``kv_grads_wait``). It rounds dx no more often than
        the unsharded model. Adding at once holds dx and dwq from the first stage. Without
        checkpointing at long context (N >> D) that is less: UPipe at U = C, MHA, float32,
        S = 32K on 4 ranks held dx and the buffer together, one N*D*4 (16 MiB) more than dx and
        dwq (issue 40). When N is about D, dwq is as large as the buffer, and the orders tie: the
        queries wait. Only the gradients autograd asks for count (``AttentionParams.needs``):
        with wq frozen, adding at once holds dx alone. With one stage and no sequence chunks
        there is nothing to combine: its dQ goes into dx and dwq as it arrives, as the single
        product of waiting would."""
        if len(self.schedule.stages) == 1 and chunks == 1:
            return False
        dx = params.needs("x")
        held = 0
        if dx and (self.schedule.n_kv_blocks > 1 or chunks > 1):
            held = _nbytes(x, self._input_grad_summed(True))
            if self._kv_grads_may_wait(chunks):
                held = min(held, self._kv_grads_bytes(x))
        buffer = x.numel() // self.dim * self.wq.numel() // self.dim * x.element_size()
        waiting = (0 if params.output_is_scratch else buffer) + held
        at_once = (_nbytes(x, self._input_grad_summed(False)) if dx else 0) + (
            _nbytes(self.wq, chunks > 1) if params.needs("wq") else 0
        )
        return waiting <= at_once

    def kv_grads_wait(self, x: Tensor, params: AttentionParams, queries_wait: bool) -> bool:
        """Whether each closed KV block's gradients wait in the sequence layout (rotated back,
        (B, L, heads, d)) for the products into dx, dwk and dwv after the last stage, rather than
        go into them when the block closes: when the query gradients wait too (dx is then not
        needed while the stages run), several stages share each of several KV blocks (the
        stages' float32 dK/dV sums make their working set the largest of the backward), and all
        the K/V gradients take fewer bytes than dx (GQA: 2 H_kv < H). dx is then one product
        per weight after the last stage, in the same order as added at each block's close:
        the same roundings, the same numbers."""
        return (
            queries_wait
            and params.needs("x")
            and self._kv_grads_may_wait(1)
            and self._kv_grads_bytes(x) < _nbytes(x, self._input_grad_summed(True))
        )

    def _kv_grads_may_wait(self, chunks: int) -> bool:
        """Several KV blocks, each shared by several stages, and no sequence chunks (FPDT's
        chunks add into dx chunk by chunk). The planner's stage shortcut never applies then
        (``HeadSchedule.stages_repeat``), so every block's waiting gradients are allocated."""
        schedule = self.schedule
        return chunks == 1 and schedule.n_kv_blocks > 1 and schedule.stages_per_kv_block > 1

    def _kv_grads_bytes(self, x: Tensor) -> int:
        """Bytes of every KV head's dK and dV on the local span, in x's dtype."""
        return 2 * x.numel() // self.dim * self.wk.numel() // self.dim * x.element_size()

    def _input_grad_summed(self, queries_wait: bool) -> bool:
        """Whether dx is summed in float32: more products through wk and wv (two per KV block)
        and through wq (one for all query heads when they wait, else one per stage) than the
        unsharded model's ``UNSHARDED_DX_ROUNDINGS`` (e.g. waiting with one or two KV blocks,
        as for Llama3 and Qwen3 with n_kv_heads <= 2 C_h, keeps x's dtype; MHA at U = C_h does
        not)."""
        queries = 1 if queries_wait else len(self.schedule.stages)
        return 2 * self.schedule.n_kv_blocks + queries > UNSHARDED_DX_ROUNDINGS

    def new_input_grad(self, like: Tensor, queries_wait: bool) -> Tensor:
        """Zeros for the layer's dx, shaped like ``like`` (this span's x), to add the products
        through wk, wv and wq into, each rounded once (``_input_grad_summed``)."""
        return accumulator(like, summed=self._input_grad_summed(queries_wait))

    def new_query_weight_grad(self, chunks: int) -> Tensor:
        """Zeros for dwq, (H, d, D), when the query gradients do not wait: each stage adds its
        heads' rows, once per sequence chunk (float32 when summed over several chunks)."""
        return accumulator(self.wq, summed=chunks > 1)

    def query_grad(self, grad_q: Exchange, stage: Stage, rope: Tensor) -> Tensor:
        """The stage's query gradient, started back to the sequence layout: once it arrives,
        rotated back and through the QK transform, (B, L, U, d)."""
        grad = apply_rope_transpose_(grad_q.result(), rope, self.rope_pairs)
        return self.qk.backward(lambda: self.project(self.stage_rows(self.wq, stage)), grad, "q")

    def add_query_grad(
        self,
        grad: Tensor,
        stage: Stage,
        waiting: Tensor | None,
        grad_x: Tensor | None,
        grad_wq: Tensor | None,
    ) -> None:
        """A stage's ``query_grad``, written into its heads of ``waiting`` (B, L, H, d), where
        every stage's query gradient waits for ``queries_backward``; or, without that buffer
        (``query_grads_wait``), added at once: ``grad_x`` += dq @ wq[stage] and the stage's
        rows of ``grad_wq`` (H, d, D) += dq.T @ x (each skipped when None: a gradient autograd
        does not ask for)."""
        if waiting is not None:
            self.write_stage(waiting, stage, grad)
            return
        heads = len(stage.query_heads)
        grad = grad.reshape(-1, heads * self.head_dim)
        if grad_x is not None:
            _add_product(grad_x, grad, self.stage_rows(self.wq, stage))
        first = stage.first_head_if_contiguous
        if grad_wq is None:
            return
        if first is not None:
            _add_product(grad_wq[first : first + heads].view(-1, self.dim), grad.t(), self.x_flat)
        else:
            product = (grad.t() @ self.x_flat).view(heads, self.head_dim, self.dim)
            index = head_index(stage.query_heads, grad_wq.device)
            grad_wq.index_add_(0, index, product.to(grad_wq.dtype))

    def store_query_grad(
        self,
        grad_q: Exchange,
        stage: Stage,
        rope: Tensor,
        waiting: Tensor | None,
        grad_x: Tensor | None,
        grad_wq: Tensor | None,
    ) -> None:
        """``add_query_grad`` of ``query_grad``."""
        self.add_query_grad(self.query_grad(grad_q, stage, rope), stage, waiting, grad_x, grad_wq)

    def queries_backward(
        self, grads: Tensor, grad_x: Tensor | None, weight_grad: bool
    ) -> Tensor | None:
        """From every query head's gradient ``grads`` (B, L, H, d) in the model's head order:
        grad_x += dq @ wq, one product over all heads (one rounding, however many stages), and
        the returned grad_wq = dq.T @ x (H*d, D) when ``weight_grad`` (else None). A None
        ``grad_x`` is not asked for."""
        grads = grads.reshape(-1, self.wq.shape[0] * self.head_dim)
        if grad_x is not None:
            _add_product(grad_x, grads, self.wq.reshape(-1, self.dim))
        return grads.t() @ self.x_flat if weight_grad else None

    def key_grad(self, grad_h: Tensor, block: int, rope: Tensor) -> Tensor:
        """A KV block's K gradient back in the sequence layout, before RoPE and the QK
        transform, (B, L, block heads * d), from its head layout (a float32 sum over the block's
        stages, chunks or ring steps, or one stage's kernel output)."""
        grad = apply_rope_transpose_(self.kv_grad(grad_h, self.x_flat.dtype), rope, self.rope_pairs)
        grad = self.qk.backward(lambda: self.project(self.block_rows(self.wk, block)), grad, "k")
        return grad.flatten(2)

    def value_grad(self, grad_h: Tensor) -> Tensor:
        """A KV block's V gradient back in the sequence layout, (B, L, block heads * d)."""
        return self.kv_grad(grad_h, self.x_flat.dtype).flatten(2)

    def kv_product(
        self, weight: Tensor, grad: Tensor, block: int, grad_x: Tensor | None, grad_w: Tensor | None
    ) -> None:
        """From a KV block's ``key_grad`` (``weight`` = wk) or ``value_grad`` (wv): grad_x +=
        d @ weight for the block's heads, and the block's rows of grad_w += d.T @ x (each
        skipped when None: a gradient autograd does not ask for)."""
        heads = self.block_heads(block)
        grad = grad.reshape(-1, (heads.stop - heads.start) * self.head_dim)
        if grad_x is not None:
            _add_product(grad_x, grad, weight[heads].reshape(-1, self.dim))
        if grad_w is not None:
            _add_product(grad_w[heads].view(-1, self.dim), grad.t(), self.x_flat)

    def kv_backward(
        self,
        grad_k_h: Tensor,
        grad_v_h: Tensor,
        block: int,
        rope: Tensor,
        grad_x: Tensor | None,
        grad_wk: Tensor | None,
        grad_wv: Tensor | None,
    ) -> None:
        """A KV block's K/V gradients (head layout) into dx, dwk and dwv."""
        self.kv_product(self.wk, self.key_grad(grad_k_h, block, rope), block, grad_x, grad_wk)
        self.kv_product(self.wv, self.value_grad(grad_v_h), block, grad_x, grad_wv)


# --- the fused op: projections, the stage loop, wo --------------------------------------------


class _Layer(AttentionProjections, _Attention):
    """The fused op's layer: the projections of the whole local shard ``x``, and the stages'
    attention."""

    def __init__(
        self, x: Tensor, weights: AttentionWeights, params: AttentionParams, doc_ids: Tensor | None
    ) -> None:
        super().__init__(x, weights, params, QKTransform(weights, params))
        self._attend_with(params, x, doc_ids)


def staged_forward(
    x: Tensor,
    weights: AttentionWeights,
    rope: Tensor,
    doc_ids: Tensor | None,
    params: AttentionParams,
) -> tuple[Tensor, Tensor, Tensor]:
    """The fused op's forward; returns (y = out @ wo.T (B, S/C, D), the saved output (B, S/C,
    H*d), lse (stages, B, U/C_h, S/R) float32). The saved output is the attention output in the
    layout backward reads it in (``saved_output``)."""
    layer = _Layer(x, weights, params, doc_ids)
    if len(layer.schedule.stages) == 1:
        return _one_stage_forward(layer, weights, rope)
    out, lse = forward_stages(layer, rope, params.overlap_stages)
    out = out.view(layer.batch, layer.local_len, -1)
    return out @ weights.wo.t(), out, lse


def _one_stage_forward(
    layer: _Layer, weights: AttentionWeights, rope: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Every head in one stage (Ulysses, ring attention, and their 2D hybrid): the output stays
    in the head layout, where backward reads it, and the sequence layout exists only to form y
    (``saved_output``)."""
    q_h, (k_h, v_h) = _ForwardInputs(layer, layer.schedule.stages[0], rope, False).result()
    o_h, lse = layer.attend(q_h, k_h, v_h)
    del q_h, k_h, v_h
    o_h = o_h.contiguous()
    y = _one_stage_output(layer, o_h) @ weights.wo.t()
    return y, o_h.view(layer.batch, layer.local_len, -1), lse.unsqueeze(0).contiguous()


def _head_layout(layer: _Layer, out: Tensor) -> Tensor:
    """One stage's saved output as (B, S_h, H/C_h, d), S_h = the head group's sequence."""
    return out.view(layer.batch, -1, layer.schedule.query_heads_per_rank, layer.head_dim)


def _one_stage_output(layer: _Layer, o_h: Tensor) -> Tensor:
    """The layer's pre-``wo`` output (B, S/C, H*d) from the head layout of one stage."""
    return layer.to_sequence(o_h).reshape(layer.batch, layer.local_len, -1)


def saved_output(out: Tensor, weights: AttentionWeights, params: AttentionParams) -> Tensor:
    """The layer's pre-``wo`` output (B, S/C, H*d), in the sequence layout, from the output the
    op saves (``staged_forward``): that output itself with several stages, whose outputs are
    written into one sequence-layout buffer as they arrive; with one stage the head layout of
    its attention output (viewed as (B, S/C, H*d)), which backward reads directly, so a
    backward without dwo exchanges nothing but dO and the gradients. Kept attention's recompute
    forms y from it (``memory.kept_attention``)."""
    if params.heads_per_stage * params.head_dim < weights.wq.shape[0]:
        return out
    batch, local_len, _ = out.shape
    o_h = out.view(batch, -1, params.query_heads_per_rank, params.head_dim)
    group = resolve_group(params.head_group, params.head_degree)
    exchange = start_heads_to_sequence(o_h, group, params.head_degree)
    return exchange.result().reshape(batch, local_len, -1)


class LayerGradients:
    """What a fused op's backward forms of one layer's gradients, whatever its loop (this
    module's stages, ``fpdt_attention``'s chunks): which gradients autograd asks for
    (``AttentionParams.needs``), whether the query gradients wait for one product after the last
    stage (``AttentionProjections.query_grads_wait``) and the buffer they wait in, dx made when
    first needed, dwo, and the record the op returns. ``layer`` is the projections of the whole
    shard (or of its first sequence chunk: every span has the same schedule and QK transform);
    ``out`` is the (B, L, H, d) buffer the waiting query gradients take the shape of."""

    def __init__(
        self,
        layer: AttentionProjections,
        x: Tensor,
        out: Tensor,
        grad_y: Tensor,
        params: AttentionParams,
        chunks: int = 1,
    ) -> None:
        self.layer, self.x, self.out, self.grad_y = layer, x, out, grad_y
        self.needs, self.scratch = params.needs, params.output_is_scratch
        self.queries = self.needs("x") or self.needs("wq") or self.needs("q_norm")
        self.queries_wait = self.queries and layer.query_grads_wait(x, params, chunks)
        self.waiting: Tensor | None = None
        """Every stage's dQ in its heads of (B, L, H, d) (``out``'s shape), when they wait."""
        self.grad_x: Tensor | None = None
        self.grad_wq = self.grad_wk = self.grad_wv = self.grad_wo = None

    def wait_buffer(self) -> Tensor:
        """Where the waiting query gradients go: the saved output itself when it is scratch
        (``AttentionParams.output_is_scratch``), else a new buffer of its size."""
        return self.out if self.scratch else torch.empty_like(self.out)

    def input_grad(self) -> None:
        """Make dx (``AttentionProjections.new_input_grad``) if it is asked for and not made."""
        if self.grad_x is None and self.needs("x"):
            self.grad_x = self.layer.new_input_grad(self.x, self.queries_wait)

    def output_weight_grad(self, output: Tensor) -> Tensor | None:
        """dwo = grad_y.T @ output, from the pre-``wo`` output in the sequence layout (None when
        not asked for)."""
        if not self.needs("wo"):
            return None
        grad_y = self.grad_y.reshape(-1, self.grad_y.shape[-1])
        return grad_y.t() @ output.reshape(grad_y.shape[0], -1)

    def finish_queries(self, whole: AttentionProjections) -> None:
        """The waiting query gradients' one product into dx and dwq (``queries_backward`` of
        the whole shard's projections ``whole``), when they wait."""
        if self.waiting is not None:
            self.input_grad()
            self.grad_wq = whole.queries_backward(self.waiting, self.grad_x, self.needs("wq"))
            self.waiting = None

    def result(self, weights: AttentionWeights) -> tuple[Tensor | None, AttentionWeights]:
        """(dx, the weights' gradients) as the op returns them: each in its input's shape and
        dtype (float32 sums are rounded once here), None where autograd asks for none."""
        grad_x, grad_wq, grad_wk, grad_wv = (
            None if g is None else g.view_as(t).to(t.dtype)
            for g, t in zip(
                (self.grad_x, self.grad_wq, self.grad_wk, self.grad_wv),
                (self.x, weights.wq, weights.wk, weights.wv),
            )
        )
        return grad_x, AttentionWeights(
            grad_wq, grad_wk, grad_wv, self.grad_wo, *self.layer.qk.weight_grads()
        )


class _Gradients(LayerGradients):
    """Where one backward's gradients go, decided once for the layer (each order holds the
    fewest bytes for its case: ``AttentionProjections.query_grads_wait`` and
    ``kv_grads_wait``), and the products that finish them.

    Only the gradients autograd asks for are formed, each buffer when its first value arrives:
    dx and dwq with the first query gradient added at once (or the first block's K/V products,
    or after the last stage), dwk and dwv with the first block's rows. dwo is formed from the
    sequence-layout output (``output()``) before the first stage when ``output_now`` (the
    waiting query gradients overwrite the saved output, or it has to be exchanged back first),
    else after the last."""

    def __init__(
        self,
        layer: _Layer,
        x: Tensor,
        out: Tensor,
        grad_y: Tensor,
        params: AttentionParams,
        output: Callable[[], Tensor],
        output_now: bool,
    ) -> None:
        super().__init__(layer, x, out, grad_y, params)
        self.output = output
        self.keys = self.needs("x") or self.needs("wk") or self.needs("wv") or self.needs("k_norm")
        self.kv_wait = layer.kv_grads_wait(x, params, self.queries_wait)
        self.kv_sums: list[Tensor | None] = [None, None]
        """The open KV block's dK and dV sums over its stages (head layout)."""
        self.pending: list[tuple[int, Tensor, Tensor]] = []
        """(block, dK, dV) of closed blocks in the sequence layout, when they wait."""
        if output_now:
            self.output_weight_grad_now()

    def output_weight_grad_now(self) -> None:
        """Form dwo now (once): for one stage, right after its kernel, when the kernel's inputs
        are gone and before dx and the other weights' gradients exist."""
        if self.grad_wo is None and self.needs("wo"):  # output() may run an exchange
            self.grad_wo = self.output_weight_grad(self.output())

    def query(self, grad_q: Exchange, stage: Stage, rope: Tensor) -> None:
        """A stage's dQ, on its way back to the sequence layout; where it goes is made once it
        has arrived (its exchange buffers are gone by then)."""
        grad = self.layer.query_grad(grad_q, stage, rope)
        if self.queries_wait:
            if self.waiting is None:
                self.waiting = self.wait_buffer()
        else:
            self.input_grad()
            if self.grad_wq is None and self.needs("wq"):
                self.grad_wq = self.layer.new_query_weight_grad(chunks=1)
        self.layer.add_query_grad(grad, stage, self.waiting, self.grad_x, self.grad_wq)

    def add_kv(self, grad_k: Tensor, grad_v: Tensor, pieces: int) -> None:
        """A stage's dK, dV (head layout), added to its KV block's sums of ``pieces`` pieces
        (``merge.add_piece``: float32 when there are several)."""
        if self.keys:
            self.kv_sums = [add_piece(t, g, pieces) for t, g in zip(self.kv_sums, (grad_k, grad_v))]

    def close_block(self, block: int, rope: Tensor) -> None:
        """The closed KV block's dK, then its dV: back in the sequence layout, into dx and dwk
        (dwv) now, or waiting (``kv_wait``). Each sum is let go as soon as it is exchanged."""
        if not self.keys:
            return
        grad_h, self.kv_sums[0] = self.kv_sums[0], None
        grad_k = self.layer.key_grad(grad_h, block, rope)
        del grad_h
        if not self.kv_wait:
            self._kv_product("wk", block, grad_k)
            del grad_k
        grad_h, self.kv_sums[1] = self.kv_sums[1], None
        grad_v = self.layer.value_grad(grad_h)
        del grad_h
        if self.kv_wait:
            self.pending.append((block, grad_k, grad_v))
        else:
            self._kv_product("wv", block, grad_v)

    def _kv_product(self, name: str, block: int, grad: Tensor) -> None:
        self.input_grad()
        attribute = f"grad_{name}"
        if self.needs(name) and getattr(self, attribute) is None:
            setattr(self, attribute, torch.zeros_like(getattr(self.layer, name)))
        weight = getattr(self.layer, name)
        self.layer.kv_product(weight, grad, block, self.grad_x, getattr(self, attribute))

    def finish(self, weights: AttentionWeights) -> tuple[Tensor | None, AttentionWeights]:
        """(dx, the weights' gradients) after the last stage: the waiting K/V gradients' and
        queries' products, then dwo."""
        while self.pending:
            block, grad_k, grad_v = self.pending.pop(0)
            self._kv_product("wk", block, grad_k)
            self._kv_product("wv", block, grad_v)
            del grad_k, grad_v
        self.finish_queries(self.layer)
        self.output_weight_grad_now()
        return self.result(weights)


def _one_stage_backward(
    layer: _Layer,
    grad_y: Tensor,
    x: Tensor,
    weights: AttentionWeights,
    rope: Tensor,
    out: Tensor,
    lse: Tensor,
    params: AttentionParams,
) -> tuple[Tensor | None, AttentionWeights]:
    """``_one_stage_forward``'s backward: dO exchanged, Q/K/V projected and exchanged again,
    the saved head-layout output read as it is; after the kernel dwo (its sequence layout is
    exchanged back for it, then freed: neither the kernel's inputs nor the other gradients are
    held then), then dQ, the only one, into dx and dwq as it arrives
    (``AttentionProjections.query_grads_wait``), then dK and dV."""
    stage = layer.schedule.stages[0]
    o_h = _head_layout(layer, out)
    buffer = out.view(layer.batch, layer.local_len, layer.schedule.n_heads, layer.head_dim)
    output = functools.partial(_one_stage_output, layer, _head_layout(layer, out))
    grads = _Gradients(layer, x, buffer, grad_y, params, output, output_now=False)
    grad_o_h = layer.output_grad(grad_y, weights.wo, stage)
    q_h, (k_h, v_h) = _ForwardInputs(layer, stage, rope, False).result()
    grad_q_h, grad_k_h, grad_v_h = layer.attend_backward(grad_o_h, q_h, k_h, v_h, o_h, lse[0])
    del q_h, k_h, v_h, o_h, grad_o_h
    grads.output_weight_grad_now()
    grads.add_kv(grad_k_h, grad_v_h, pieces=1)
    del grad_k_h, grad_v_h
    sent = layer.start_to_sequence(grad_q_h) if grads.queries else None
    del grad_q_h
    if sent is not None:  # dQ first: dK/dV, a quarter of its size with GQA, wait meanwhile
        grads.query(sent, stage, rope)
    del sent
    grads.close_block(stage.kv_block, rope)
    return grads.finish(weights)


def staged_backward(
    grad_y: Tensor,
    x: Tensor,
    weights: AttentionWeights,
    rope: Tensor,
    doc_ids: Tensor | None,
    out: Tensor,
    lse: Tensor,
    params: AttentionParams,
) -> tuple[Tensor | None, AttentionWeights]:
    """The fused op's backward, stage by stage from x, the output and the LSEs; returns (dx, the
    weights' gradients), None for those autograd does not ask for.

    Each stage's dQ, back in the sequence layout, waits in its heads of a (B, S/C, H, d) buffer:
    the saved output itself when it is scratch (``AttentionParams.output_is_scratch``; a stage's
    slice of it is read before its dQ is written there), and dx += dQ @ wq and dwq = dQ.T @ x are
    one product each after the last stage; or, where that holds less, each stage's dQ goes into
    dx and dwq at once (``_Gradients``). A KV block's dK, dV are summed over its stages in
    float32 (``merge.add_piece``; a block of one stage keeps the kernel's own), then go into
    dx, dwk and dwv when the block closes, or wait for the end (GQA, queries waiting: then no
    dx is held while the stages run)."""
    layer = _Layer(x, weights, params, doc_ids)
    if len(layer.schedule.stages) == 1:
        return _one_stage_backward(layer, grad_y, x, weights, rope, out, lse, params)
    sequence = out
    out = out.view(layer.batch, layer.local_len, layer.schedule.n_heads, params.head_dim)
    grads = _Gradients(
        layer,
        x,
        out,
        grad_y,
        params,
        lambda: sequence,
        # the waiting dQ overwrites the output: dwo reads it first
        output_now=params.output_is_scratch and layer.query_grads_wait(x, params),
    )
    output_grad = functools.partial(layer.output_grad_slice, grad_y, weights.wo)
    backward_stages(layer, grads, rope, out, lse, output_grad, params.overlap_stages)
    return grads.finish(weights)


_OP = AttentionOp("attention", staged_forward, staged_backward, saved_output)


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


# --- the op-level entry: the stage loop on given q, k, v --------------------------------------


class _GivenLayer(GivenQKV, _Attention):
    """The op-level entry's layer: a stage's queries and a block's keys and values read from
    the given ``q``, ``k``, ``v`` of the local shard, and the stages' attention."""

    def __init__(
        self, q: Tensor, k: Tensor, v: Tensor, params: AttentionParams, doc_ids: Tensor | None
    ) -> None:
        super().__init__(q, k, v, params)
        self._attend_with(params, q, doc_ids)


class _InputGradients:
    """Where ``backward_stages`` puts the gradients of given q, k, v: each stage's dQ into its
    heads of dq, each KV block's dK, dV (summed over its stages in float32, then cast) into its
    heads of dk and dv, all in the sequence layout of the inputs."""

    queries = keys = True

    def __init__(self, layer: _GivenLayer) -> None:
        self.layer = layer
        self.grad_q = torch.empty_like(layer.q)
        self.grad_k, self.grad_v = torch.empty_like(layer.k), torch.empty_like(layer.v)
        self.kv_sums: list[Tensor | None] = [None, None]

    def query(self, grad_q: Exchange, stage: Stage, rope: None) -> None:
        self.layer.write_stage(self.grad_q, stage, grad_q.result())

    def add_kv(self, grad_k: Tensor, grad_v: Tensor, pieces: int) -> None:
        self.kv_sums = [add_piece(t, g, pieces) for t, g in zip(self.kv_sums, (grad_k, grad_v))]

    def close_block(self, block: int, rope: None) -> None:
        heads = self.layer.block_heads(block)
        for index, target in enumerate((self.grad_k, self.grad_v)):
            grad_h, self.kv_sums[index] = self.kv_sums[index], None
            target[:, :, heads] = self.layer.kv_grad(grad_h, target.dtype)
            del grad_h


def _lse_in_sequence(layer: _GivenLayer, lse: Tensor) -> Tensor:
    """(B, H, L) float32: every stage's LSE (B, U/C_h, S_h), head layout, back in the inputs'
    sequence layout and the model's head order."""
    whole = lse.new_empty(layer.batch, layer.local_len, layer.schedule.n_heads, 1)
    for index, stage in enumerate(layer.schedule.stages):
        layer.write_lse(whole, stage, lse[index])
    return whole.squeeze(-1).transpose(1, 2).contiguous()


def qkv_forward(
    q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None, params: AttentionParams
) -> tuple[Tensor, Tensor, Tensor]:
    """The op-level entry's forward: (out (B, L, H, d), lse (B, H, L), lse of each stage)."""
    layer = _GivenLayer(q, k, v, params, doc_ids)
    out, lse = forward_stages(layer, None, params.overlap_stages)
    return out, _lse_in_sequence(layer, lse), lse


def qkv_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    doc_ids: Tensor | None,
    out: Tensor,
    lse: Tensor,
    params: AttentionParams,
) -> tuple[Tensor, Tensor, Tensor]:
    """The op-level entry's backward: (dq, dk, dv)."""
    layer = _GivenLayer(q, k, v, params, doc_ids)
    grads = _InputGradients(layer)
    output_grad = functools.partial(layer.read_stage, grad_out)
    backward_stages(layer, grads, None, out, lse, output_grad, params.overlap_stages)
    return grads.grad_q, grads.grad_k, grads.grad_v


_QKV_OP = QKVAttentionOp("qkv_attention", qkv_forward, qkv_backward)


def qkv_attention(
    q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None, params: AttentionParams
) -> tuple[Tensor, Tensor]:
    """Differentiable staged attention of given q (B, S/C, H, d), k, v (B, S/C, H_kv, d), this
    rank's shard in the style's sequence layout, already rotated: (out (B, S/C, H, d), lse
    (B, H, S/C) float32, no gradient). The stage loop of the fused op without its projections
    (``ContextParallelAttention.attention`` is the public entry)."""
    return _QKV_OP(q, k, v, doc_ids, params)
