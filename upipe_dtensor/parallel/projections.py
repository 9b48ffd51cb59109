"""The fused attention ops' projections: a stage's queries and a KV block's keys and values
projected from the local shard (``x @ w[stage rows].T``), transformed (the family's QK-norm,
``qk_transform``) and rotated, and in backward the products of their gradients into dx and the
weights' gradients, in the order that holds the fewest bytes (``query_grads_wait``,
``kv_grads_wait``).

``AttentionProjections`` is ``head_stages.HeadStages`` for a span of the local sequence ``x``:
the whole shard (UPipe, Ulysses, ring) or one sequence chunk of it (FPDT). Stages that are not
contiguous gather their rows of ``wq`` (weights are small; activations never move).
"""

from __future__ import annotations

import functools

from torch import Tensor

from upipe_dtensor.kernels.merge import accumulation_dtype, accumulator
from upipe_dtensor.kernels.rope import apply_rope_, apply_rope_transpose_
from upipe_dtensor.parallel.all_to_all import Exchange
from upipe_dtensor.parallel.attention_op import AttentionParams, AttentionWeights
from upipe_dtensor.parallel.head_schedule import Stage
from upipe_dtensor.parallel.head_stages import HeadStages, head_index
from upipe_dtensor.parallel.qk_transform import QKTransform

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
    ops). ``qk`` is the layer call's per-head transform of Q and K, shared by every span of the
    call."""

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
