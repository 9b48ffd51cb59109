"""The head-stage plumbing every Ulysses-family op shares: project a stage's heads from the local
shard, transform them (the family's QK-norm, ``qk_transform``) and rotate them, exchange them
between the sequence and head layouts, and write results back.

``AttentionProjections`` holds the per-call constants of one attention layer (head schedule,
process groups, shapes, weight views) for a span of the local sequence: the whole shard (UPipe,
Ulysses, ring) or one sequence chunk of it (FPDT). Query head ``h`` always uses KV head
``h // n_rep`` (the model's own GQA grouping); stages that are not contiguous gather their rows of
``wq`` (weights are small; activations never move).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from upipe_dtensor.kernels.merge import accumulation_dtype, accumulator
from upipe_dtensor.kernels.rope import apply_rope_, apply_rope_transpose_
from upipe_dtensor.kernels.tiling import visited
from upipe_dtensor.parallel.all_to_all import (
    Exchange,
    _group,
    sequence_to_heads,
    start_exchange,
    start_heads_to_sequence,
)
from upipe_dtensor.parallel.attention_op import AttentionParams, AttentionWeights
from upipe_dtensor.parallel.head_schedule import HeadSchedule, Stage, make_head_schedule
from upipe_dtensor.parallel.qk_transform import QKTransform
from upipe_dtensor.runtime.host_store import to_device

UNSHARDED_DX_ROUNDINGS = 5
"""How often the unsharded model rounds an attention layer's dx in bf16: three products (through
wq, wk and wv) and the two sums of them (autograd adds the gradients of x's three uses)."""


@functools.cache
def _head_index(heads: tuple[int, ...], device: torch.device) -> Tensor:
    """A stage's head indices on ``device``, built once and sent without the host waiting
    (``host_store.to_device``): a blocking host-to-GPU copy stalls the CPU until the stream
    catches up."""
    return to_device(torch.tensor(heads), device)


def forget_head_indices() -> None:
    """Drop the cached head indices: the memory planner's fake tensors must not outlive one plan
    (and each plan must count the indices it creates)."""
    _head_index.cache_clear()


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


def resolve_group(group_name: str, size: int) -> dist.ProcessGroup | None:
    """The process group named ``group_name`` (None for a group of one), checked for its size."""
    if size == 1:
        return None
    group = _group(group_name)
    if group.size() != size:
        raise ValueError(f"process group {group_name!r} has {group.size()} ranks, expected {size}")
    return group


class AttentionProjections:
    """One layer's projections of a span of the local sequence ``x`` (B, L, D). ``qk`` is the
    layer call's per-head transform of Q and K, shared by every span of the call."""

    def __init__(
        self, x: Tensor, weights: AttentionWeights, params: AttentionParams, qk: QKTransform
    ) -> None:
        wq, wk, wv = weights.wq, weights.wk, weights.wv
        self.qk = qk
        self.rope_pairs = params.rope_pairs
        self.batch, self.local_len, self.dim = x.shape
        self.head_dim = head_dim = params.head_dim
        self.schedule: HeadSchedule = make_head_schedule(
            wq.shape[0] // head_dim,
            wk.shape[0] // head_dim,
            params.head_degree,
            params.heads_per_stage,
        )
        self.head_degree = params.head_degree
        self.group = resolve_group(params.head_group, params.head_degree)
        # Weights as (heads, head_dim, dim): a stage picks whole heads.
        self.wq = wq.view(-1, head_dim, self.dim)
        self.wk = wk.view(-1, head_dim, self.dim)
        self.wv = wv.view(-1, head_dim, self.dim)
        self.x_flat = x.reshape(-1, self.dim)

    def stage_order(self) -> list[int] | range:
        """The stages a stage loop runs, by index: every one, except when planning on fake
        tensors a schedule whose stages repeat (``HeadSchedule.stages_repeat``), where the first
        two and the last run, the second standing for the middle ones
        (``kernels.tiling.visited``). The stage buffers (output, LSEs) are allocated whole
        before the loop and every stage's head indices are built here (they are kept for the
        run), so a skipped stage leaves nothing behind; the visited stages allocate what every
        stage would, and count the work of all of them."""
        for stage in self.schedule.stages:
            if stage.first_head_if_contiguous is None:
                _head_index(stage.query_heads, self.x_flat.device)
        stages = range(len(self.schedule.stages))
        return visited(self.x_flat, stages) if self.schedule.stages_repeat else stages

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
        """x @ rows.T as (B, L, heads, d)."""
        return (self.x_flat @ rows.t()).view(self.batch, self.local_len, -1, self.head_dim)

    def start_to_heads(self, make: Callable[[], Tensor]) -> Exchange:
        """Start the exchange of the (B, L, h, d) tensor ``make()`` makes to the head layout;
        that tensor is let go once its send copy exists (``all_to_all.sequence_to_heads``), so
        it, the send and the receive buffer are never all held at once."""
        if self.head_degree == 1:
            return Exchange.done(make())
        return start_exchange(*sequence_to_heads(make(), self.head_degree), self.group)

    def start_to_sequence(self, t: Tensor) -> Exchange:
        """Start the exchange of ``t`` (B, S, h, d) to the sequence layout (B, L, h*C_h, d). A
        kernel's output is usually its send layout already (with batch 1), so nothing is held
        twice."""
        return start_heads_to_sequence(t, self.group, self.head_degree)

    def to_heads(self, make: Callable[[], Tensor]) -> Tensor:
        return self.start_to_heads(make).result()

    def to_sequence(self, t: Tensor) -> Tensor:
        return self.start_to_sequence(t).result()

    def key(self, block: int, rope: Tensor) -> Tensor:
        """K of one KV block (B, L, heads, d): projected, transformed, rotated, replicated if
        needed."""
        k = self.qk.forward(self.project(self.block_rows(self.wk, block)), "k")
        return self._replicated(apply_rope_(k, rope, self.rope_pairs))

    def value(self, block: int) -> Tensor:
        """V of one KV block (B, L, heads, d), replicated if needed."""
        return self._replicated(self.project(self.block_rows(self.wv, block)))

    def query(self, stage: Stage, rope: Tensor) -> Tensor:
        """Q of one stage (B, L, U, d): projected, transformed and rotated."""
        q = self.qk.forward(self.project(self.stage_rows(self.wq, stage)), "q")
        return apply_rope_(q, rope, self.rope_pairs)

    def _replicated(self, kv: Tensor) -> Tensor:
        rep = self.schedule.kv_replication
        return kv.repeat_interleave(rep, dim=2) if rep > 1 else kv

    def start_key_for_block(self, block: int, rope: Tensor) -> Exchange:
        return self.start_to_heads(functools.partial(self.key, block, rope))

    def start_value_for_block(self, block: int) -> Exchange:
        return self.start_to_heads(functools.partial(self.value, block))

    def start_kv_for_block(self, block: int, rope: Tensor) -> tuple[Exchange, Exchange]:
        """K and V of one KV block on their way to the head layout."""
        return self.start_key_for_block(block, rope), self.start_value_for_block(block)

    def kv_for_block(self, block: int, rope: Tensor) -> tuple[Tensor, Tensor]:
        """K and V of one KV block in the head layout."""
        k, v = self.start_kv_for_block(block, rope)
        return k.result(), v.result()

    def start_query_for_stage(self, stage: Stage, rope: Tensor) -> Exchange:
        return self.start_to_heads(functools.partial(self.query, stage, rope))

    def query_for_stage(self, stage: Stage, rope: Tensor) -> Tensor:
        return self.start_query_for_stage(stage, rope).result()

    def write_stage(self, buffer: Tensor, stage: Stage, values: Tensor) -> None:
        """buffer[:, :, stage heads] = values, for (B, L, H, d) buffers."""
        first = stage.first_head_if_contiguous
        if first is not None:
            buffer[:, :, first : first + values.shape[2]] = values
        else:
            buffer.index_copy_(2, _head_index(stage.query_heads, buffer.device), values)

    def stage_columns(self, wo: Tensor, stage: Stage) -> Tensor:
        """The stage's query-head columns of the output projection ``wo`` (D, U*d)."""
        heads = wo.view(wo.shape[0], -1, self.head_dim)
        first = stage.first_head_if_contiguous
        if first is not None:
            return heads[:, first : first + len(stage.query_heads)].reshape(wo.shape[0], -1)
        return heads.index_select(1, _head_index(stage.query_heads, wo.device)).reshape(
            wo.shape[0], -1
        )

    def output_grad_slice(self, grad_y: Tensor, wo: Tensor, stage: Stage) -> Tensor:
        """The stage's slice of the gradient before ``wo``, (B, L, U, d): grad_y @ wo[:, stage
        columns]. The whole (tokens, H*d) gradient never exists."""
        grad = grad_y.reshape(-1, grad_y.shape[-1]) @ self.stage_columns(wo, stage)
        return grad.view(self.batch, self.local_len, -1, self.head_dim)

    def start_output_grad(self, grad_y: Tensor, wo: Tensor, stage: Stage) -> Exchange:
        """``output_grad_slice`` on its way to the head layout."""
        return self.start_to_heads(functools.partial(self.output_grad_slice, grad_y, wo, stage))

    def output_grad(self, grad_y: Tensor, wo: Tensor, stage: Stage) -> Tensor:
        return self.start_output_grad(grad_y, wo, stage).result()

    def read_stage(self, buffer: Tensor, stage: Stage) -> Tensor:
        first = stage.first_head_if_contiguous
        if first is not None:
            return buffer[:, :, first : first + len(stage.query_heads)]
        return buffer.index_select(2, _head_index(stage.query_heads, buffer.device))

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
            index = _head_index(stage.query_heads, grad_wq.device)
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
        grad = apply_rope_transpose_(self._kv_grad(grad_h), rope, self.rope_pairs)
        grad = self.qk.backward(lambda: self.project(self.block_rows(self.wk, block)), grad, "k")
        return grad.flatten(2)

    def value_grad(self, grad_h: Tensor) -> Tensor:
        """A KV block's V gradient back in the sequence layout, (B, L, block heads * d)."""
        return self._kv_grad(grad_h).flatten(2)

    def kv_product(
        self, weight: Tensor, grad: Tensor, block: int, grad_x: Tensor | None, grad_w: Tensor | None
    ) -> None:
        """From a KV block's ``key_grad`` (``weight`` = wk) or ``value_grad`` (wv): grad_x +=
        d @ weight for the block's heads, and the block's rows of grad_w += d.T @ x (each
        skipped when None: a gradient autograd does not ask for)."""
        start, stop = self.schedule.kv_block_heads(block)
        grad = grad.reshape(-1, (stop - start) * self.head_dim)
        if grad_x is not None:
            _add_product(grad_x, grad, weight[start:stop].reshape(-1, self.dim))
        if grad_w is not None:
            _add_product(grad_w[start:stop].view(-1, self.dim), grad.t(), self.x_flat)

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

    def _kv_grad(self, grad_h: Tensor) -> Tensor:
        """A KV block's gradient in the head layout -> model KV heads on the local span."""
        grad = self.to_sequence(grad_h.to(self.x_flat.dtype))
        rep = self.schedule.kv_replication
        if rep > 1:  # replicas of one KV head each got part of the gradient: sum them
            grad = grad.unflatten(2, (-1, rep)).sum(3)
        return grad
