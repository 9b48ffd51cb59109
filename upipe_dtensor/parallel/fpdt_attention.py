"""FPDT (Fully Pipelined Distributed Transformer, arXiv 2408.16978): Ulysses attention run one
sequence chunk at a time, with the earlier chunks' K/V in host memory.

The local shard ``x`` (B, S/C, D) is u chunks in the chunk-strided layout of
``layouts.chunked_positions`` (the paper's Figure 6): rank r's chunk i is global piece i*C + r, so
the all-to-all of chunk i gathers one contiguous global range and causality holds chunk by chunk.
For each head stage (one stage of all H heads is FPDT as published; U < H stages are UPipe x
FPDT, heads and sequence both chunked) and each chunk i:

    q_i, k_i, v_i = all_to_all(rope(qk(x_i @ w.T)))   (B, S/u, U/C, d)  global chunk i, own heads
    o_i, lse_i    = causal(q_i, k_i, v_i)              the diagonal block
    for j < i:      fetch k_j, v_j from the host        one earlier chunk on the device at a time
                    (o_i, lse_i) <- merge with full(q_i, k_j, v_j)     online softmax, float32
    park k_i, v_i on the host; out[chunk i, stage heads] = all_to_all(o_i)

Backward follows the paper's order (section 4.2): first every chunk's q, o and dO are exchanged to
the head layout and parked on the host; then the outer loop runs over K/V chunks j and the inner
loop over query chunks i >= j, so dK_j, dV_j are final after one inner loop and dQ_i after the
outer step j = i; each final gradient goes straight back through its all-to-all into dx and the
weight gradients. Partial dQ (and, for KV blocks shared by several stages, partial dK/dV) wait on
the host. The next chunk is prefetched while the current one computes (side-stream copies into
pinned buffers on CUDA, through the shared ``runtime.host_store``; plain copies on CPU).

Like UPipe (and unlike DeepSpeed's FPDT) the op saves only x, the output and the LSEs and
re-projects each chunk in backward: under full activation checkpointing, which every long-context
recipe uses, saved chunks would be discarded and recomputed anyway, and nothing of a layer stays
on the host between its forward and backward.

Memory bound (per rank, N = B*S/C local tokens, c = N/u tokens per chunk, per-rank heads h = U/C):
  device: the output buffer (N*H*d) and, for one chunk, q, k, v, o and their all-to-all buffers
          (~c*U*d each, local and gathered), one fetched earlier K/V chunk (+ the next in flight),
          the float32 running output of the chunk; in backward one query chunk's q, o, dO, dQ and
          one K/V chunk's k, v and float32 dK, dV. None of it grows with the number of chunks.
          Sums across chunks and a KV block's stages are float32: dQ, dK, dV and, with several
          chunks, dwk and dwv (float32 copies of wk, wv, independent of N). Under activation
          checkpointing each final dQ_i waits in the saved output buffer (the stage's chunks of
          it are parked first), and dx (N*D*b, created when the first KV block closes; float32
          beyond two KV blocks) and dwq are one product each at the end, as in
          ``staged_attention``. Without it, that buffer would be a new N*H*d*b beside dx, which
          exists from the first K/V chunk on: at long context (N >> D) each final dQ_i goes
          into its rows of dx (float32 beyond five products) and into dwq (float32) at once
          instead (``AttentionProjections.query_grads_wait``).
  host  : the K/V chunks of the current KV block (2*N*C*k*d), and in backward q, o, dO and
          partial dQ of the stage (~4*N*U*d) plus partial dK/dV between the stages of a block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from upipe_dtensor.kernels.attention import attention_backward, attention_forward
from upipe_dtensor.kernels.backends import op_kernel
from upipe_dtensor.kernels.merge import PartialAttention, accumulation_dtype, accumulator
from upipe_dtensor.kernels.tiling import in_order, visited
from upipe_dtensor.parallel.all_to_all import Exchange
from upipe_dtensor.parallel.attention_op import (
    AttentionOp,
    AttentionParams,
    AttentionWeights,
    QKVAttentionOp,
)
from upipe_dtensor.parallel.head_schedule import Stage
from upipe_dtensor.parallel.head_stages import GivenQKV, HeadStages
from upipe_dtensor.parallel.layouts import split_lengths
from upipe_dtensor.parallel.qk_transform import QKTransform
from upipe_dtensor.parallel.staged_attention import AttentionProjections, LayerGradients
from upipe_dtensor.runtime.host_store import HostStore, Parked, named_host_store


class _Chunks:
    """The per-call constants: one ``HeadStages`` span per chunk (``make_span(rows)``: projected
    from the chunk's rows of x, or reading given q, k, v), where each chunk sits in the local
    shard and in the global sequence, and the local kernel."""

    def __init__(
        self,
        like: Tensor,
        params: AttentionParams,
        doc_ids: Tensor | None,
        make_span: Callable[[slice], HeadStages],
    ) -> None:
        self.like = like
        self.local = []  # [start, end) of each chunk in the local shard
        self.gathered = []  # [start, end) of each chunk in the global sequence (after all-to-all)
        start = 0
        for length in split_lengths(like.shape[1], params.chunks):
            self.local.append(slice(start, start + length))
            self.gathered.append(
                slice(start * params.head_degree, (start + length) * params.head_degree)
            )
            start += length
        self.spans = [make_span(rows) for rows in self.local]
        self.schedule = self.spans[0].schedule
        count = len(self.spans)
        equal = len({rows.stop - rows.start for rows in self.local}) == 1
        self.visits = visited(like, range(count)) if equal else range(count)
        """The chunks a loop over all of them runs (``kernels.tiling.visited``; planning alike
        chunks only): the second stands for every middle one, the others park stand-ins."""
        self.shortened = len(self.visits) < count
        self.backend = op_kernel(
            params.backend, params.kernel_device, like, documents=doc_ids is not None
        )
        self.scale = params.scale
        self.parking = _Parking(
            named_host_store(params.store_name, like.device) if params.chunks > 1 else None
        )


def _rows(table: Tensor | None, rows: slice) -> Tensor | None:
    """Token rows of a RoPE table, (S, d/2, 2) or (B, S, d/2, 2) (None: the op-level entry's
    inputs are rotated already)."""
    if table is None:
        return None
    return table[rows] if table.dim() == 3 else table[:, rows]


def _docs(doc_ids: Tensor | None, rows: slice) -> Tensor | None:
    return None if doc_ids is None else doc_ids[:, rows]


class _Parking:
    """Chunk tensors in host memory, or kept on the device when there is only one chunk."""

    def __init__(self, store: HostStore | None) -> None:
        self.store = store
        self.slots: dict[object, Tensor | Parked] = {}

    def put(self, key: object, tensor: Tensor) -> None:
        self.slots[key] = tensor if self.store is None else self.store.park(tensor)

    def prefetch(self, *keys: object) -> None:
        for key in keys:
            if self.store is not None and key in self.slots:
                self.store.prefetch(self.slots[key])

    def get(self, key: object, *, release: bool) -> Tensor:
        held = self.slots.pop(key) if release else self.slots[key]
        return held if self.store is None else self.store.retrieve(held, release=release)

    def drop(self, key: object) -> None:
        """Give up ``key``'s slot without fetching it (what a skipped chunk released)."""
        held = self.slots.pop(key)
        if self.store is not None:
            self.store.release(held)

    def skipped(self, i: int, drop: tuple[str, ...] = (), stand_ins: tuple[str, ...] = ()) -> None:
        """What chunk ``i``, which the planner skips (``kernels.tiling.in_order``), leaves in
        host memory: the slots of ``drop`` given up (what its step would release), then
        stand-ins for those of ``stand_ins``."""
        for name in drop:
            self.drop((name, i))
        for name in stand_ins:
            self.stand_in((name, i), like=(name, 1))

    def stand_in(self, key: object, like: object) -> None:
        """Park under ``key`` a tensor shaped like ``like``'s, never read for its values: what a
        chunk the planner skips would have parked (``kernels.tiling.in_order``)."""
        held = self.slots[like]
        if self.store is None:
            self.slots[key] = torch.empty_like(held)
            return
        self.put(key, torch.empty_like(held.host, device=held.device))

    def clear(self) -> None:
        for held in self.slots.values():
            if self.store is not None:
                self.store.release(held)
        self.slots.clear()


def forward_chunks(
    layer: _Chunks, rope: Tensor | None, doc_ids: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The forward chunk loop (the module docstring): (out (B, L, H, d) in the sequence layout
    and the model's head order; lse (stages, B, U/C, S) float32, each stage's in the head
    layout)."""
    schedule, backend, scale, parking = layer.schedule, layer.backend, layer.scale, layer.parking
    like, first = layer.like, layer.spans[0]
    out = like.new_empty(like.shape[0], like.shape[1], schedule.n_heads, first.head_dim)
    lse = like.new_empty(
        len(schedule.stages),
        like.shape[0],
        schedule.query_heads_per_rank,
        like.shape[1] * first.head_degree,
        dtype=accumulation_dtype(like.dtype),
    )
    # Planning: a visited middle chunk (i = 1) stands for every middle one, whose loops over the
    # earlier chunks grow with i, so its loop stands for their average.
    middle_earlier = (len(layer.spans) - 1) / 2
    for index in first.stage_order():
        stage = schedule.stages[index]
        # planning: a skipped chunk leaves its K/V in host memory, no work
        kv = ("k", "v") if stage.opens_kv_block else ()
        skipped = functools.partial(parking.skipped, stand_ins=kv)
        for i in in_order(layer.visits, range(len(layer.spans)), skipped):
            span = layer.spans[i]
            rope_i, docs_i = _rows(rope, layer.local[i]), _docs(doc_ids, layer.gathered[i])
            if stage.opens_kv_block:
                k_i, v_i = span.kv_for_block(stage.kv_block, rope_i)
                parking.put(("k", i), k_i)
                parking.put(("v", i), v_i)
            else:
                k_i, v_i = (
                    parking.get(("k", i), release=False),
                    parking.get(("v", i), release=False),
                )
            q_i = span.query_for_stage(stage, rope_i)
            partial = PartialAttention(
                *attention_forward(
                    q_i, k_i, v_i, scale, backend, causal=True, q_docs=docs_i, k_docs=docs_i
                )
            )
            del k_i, v_i
            earlier = visited(q_i, range(i), middle_earlier if layer.shortened and i == 1 else None)
            for step, j in enumerate(earlier):
                k_j, v_j = (
                    parking.get(("k", j), release=False),
                    parking.get(("v", j), release=False),
                )
                if step + 1 < len(earlier):  # the next earlier chunk travels while this one runs
                    parking.prefetch(("k", earlier[step + 1]), ("v", earlier[step + 1]))
                partial.add(
                    *attention_forward(
                        q_i,
                        k_j,
                        v_j,
                        scale,
                        backend,
                        causal=False,
                        q_docs=docs_i,
                        k_docs=_docs(doc_ids, layer.gathered[j]),
                    )
                )
                del k_j, v_j
            o_i, lse[index, :, :, layer.gathered[i]] = partial.result(like.dtype)
            del q_i, partial
            span.write_stage(out[:, layer.local[i]], stage, span.to_sequence(o_i))
            del o_i
        if stage.closes_kv_block:
            parking.clear()
    return out, lse


def backward_chunks(
    layer: _Chunks,
    grads: _Gradients | _InputGradients,
    rope: Tensor | None,
    doc_ids: Tensor | None,
    out: Tensor,
    lse: Tensor,
) -> None:
    """The paper's backward order per stage (the module docstring), from ``out`` (B, L, H, d)
    and ``lse`` as ``forward_chunks`` made them: each final dQ_i and each K/V chunk's final dK,
    dV of a block go to ``grads`` (where they go is theirs). Sums across chunks and a KV block's
    stages (dQ, dK, dV) are float32."""
    schedule, backend, scale, parking = layer.schedule, layer.backend, layer.scale, layer.parking
    like = layer.like
    count = len(layer.spans)
    # What the planner counts: a visited middle K/V chunk (j = 1) stands for every middle one,
    # whose query loops shrink with j, so its query loop stands for their average.
    middle_queries = sum(count - j for j in range(1, count - 1)) / max(count - 2, 1)
    for index in layer.spans[0].stage_order():
        stage = schedule.stages[index]
        parked = ("k", "v", "q", "o", "do") if stage.opens_kv_block else ("q", "o", "do")
        # every chunk to the head layout (planning: a skipped chunk's host copies, no work)
        skipped = functools.partial(parking.skipped, stand_ins=parked)
        for i in in_order(layer.visits, range(count), skipped):
            span = layer.spans[i]
            rope_i = _rows(rope, layer.local[i])
            if stage.opens_kv_block:
                k_i, v_i = span.kv_for_block(stage.kv_block, rope_i)
                parking.put(("k", i), k_i)
                parking.put(("v", i), v_i)
                del k_i, v_i
            parking.put(("q", i), span.query_for_stage(stage, rope_i))
            read = functools.partial(span.read_stage, out[:, layer.local[i]], stage)
            parking.put(("o", i), span.to_heads(read))
            parking.put(("do", i), grads.output_grad(i, stage))

        # Planning (fake tensors) runs a few of the identical chunks and chunk pairs
        # (``kernels.tiling``); a skipped K/V chunk j gives up the host copies its step would
        # release and parks stand-ins for the partial dK/dV it would leave for the next stage.
        skipped = functools.partial(
            parking.skipped,
            drop=(() if stage.opens_kv_block else ("dk", "dv")) + ("q", "o", "do", "dq"),
            stand_ins=() if stage.closes_kv_block else ("dk", "dv"),
        )
        for j in in_order(layer.visits, range(count), skipped):  # outer: K/V chunks
            k_j, v_j = parking.get(("k", j), release=False), parking.get(("v", j), release=False)
            if stage.opens_kv_block:
                grad_k_j, grad_v_j = accumulator(k_j), accumulator(v_j)
            else:
                grad_k_j = parking.get(("dk", j), release=True)
                grad_v_j = parking.get(("dv", j), release=True)
            # The first pass over the query chunks parks every partial dQ (stand-ins for the
            # skipped ones, so host memory is counted whole).
            stands_for = middle_queries if layer.shortened and j == 1 else None
            chunks = layer.visits if j == 0 else visited(like, range(j, count), stands_for)
            run = [i for i in range(j, count) if i in chunks]  # the query chunks computed
            # a skipped chunk's partial dQ: parked by the first pass (a stand-in), taken and
            # parked again by each later one (nothing left)
            partial_dq = functools.partial(parking.skipped, stand_ins=("dq",) if j == 0 else ())
            for i in in_order(chunks, range(j, count), partial_dq):  # inner: those that see j
                q_i = parking.get(("q", i), release=i == j)
                o_i = parking.get(("o", i), release=i == j)
                do_i = parking.get(("do", i), release=i == j)
                grad_q_i = accumulator(q_i) if j == 0 else parking.get(("dq", i), release=True)
                step = run.index(i)
                if step + 1 < len(run):  # the next query chunk travels while this one computes
                    following = run[step + 1]
                    parking.prefetch(
                        ("q", following), ("o", following), ("do", following), ("dq", following)
                    )
                dq, dk, dv = attention_backward(
                    do_i,
                    q_i,
                    k_j,
                    v_j,
                    o_i,
                    lse[index, :, :, layer.gathered[i]],
                    scale,
                    backend,
                    causal=i == j,
                    q_docs=_docs(doc_ids, layer.gathered[i]),
                    k_docs=_docs(doc_ids, layer.gathered[j]),
                )
                del q_i, o_i, do_i
                grad_q_i += dq
                grad_k_j += dk
                grad_v_j += dv
                del dq, dk, dv
                if i != j:
                    parking.put(("dq", i), grad_q_i)
                elif grads.queries:  # every key chunk of query chunk i is done: dQ_i is final
                    sent = layer.spans[j].start_to_sequence(grad_q_i.to(like.dtype))
                    grads.query(i, sent, stage, _rows(rope, layer.local[i]))
                del grad_q_i
            del k_j, v_j
            if stage.closes_kv_block:
                grads.kv(j, grad_k_j, grad_v_j, stage.kv_block, _rows(rope, layer.local[j]))
            else:  # later stages of this KV block add to the same dK/dV
                parking.put(("dk", j), grad_k_j)
                parking.put(("dv", j), grad_v_j)
            del grad_k_j, grad_v_j
        if stage.closes_kv_block:
            parking.clear()


# --- the fused op: projections, the chunk loop, wo --------------------------------------------


def _fused_chunks(
    x: Tensor, weights: AttentionWeights, params: AttentionParams, doc_ids: Tensor | None
) -> _Chunks:
    qk = QKTransform(weights, params)  # the call's one, shared by every chunk's projections
    return _Chunks(
        x, params, doc_ids, lambda rows: AttentionProjections(x[:, rows], weights, params, qk)
    )


def fpdt_forward(
    x: Tensor,
    weights: AttentionWeights,
    rope: Tensor,
    doc_ids: Tensor | None,
    params: AttentionParams,
) -> tuple[Tensor, Tensor, Tensor]:
    """The fused op's forward; returns (y = out @ wo.T (B, S/C, D), out (B, S/C, H*d),
    lse (stages, B, U/C, S) float32)."""
    layer = _fused_chunks(x, weights, params, doc_ids)
    out, lse = forward_chunks(layer, rope, doc_ids)
    out = out.view(x.shape[0], x.shape[1], -1)
    return out @ weights.wo.t(), out, lse


class _Gradients(LayerGradients):
    """Where the fused op's backward puts each final dQ_i and each K/V chunk's dK, dV: into dx
    and the weights' gradients. Each final dQ_i waits in its rows and stage heads of one
    (B, S/C, H, d) buffer (the saved output, when it is scratch: a stage's slices of it are
    parked before any dQ of the stage is final), or, when that buffer would be new and dx and
    dwq hold less, goes into them at once (``AttentionProjections.query_grads_wait``); then dx
    += dQ @ wq and dwq = dQ.T @ x are one product each at the end, as in ``staged_backward``
    (``staged_attention.LayerGradients``, which both share); dx is created when the first KV
    block closes. dwk, dwv are float32 sums over the chunks."""

    def __init__(
        self,
        chunks: _Chunks,
        x: Tensor,
        weights: AttentionWeights,
        out: Tensor,
        grad_y: Tensor,
        params: AttentionParams,
    ) -> None:
        heads = out.view(x.shape[0], x.shape[1], chunks.schedule.n_heads, params.head_dim)
        super().__init__(chunks.spans[0], x, heads, grad_y, params, params.chunks)
        self.chunks, self.weights, self.params = chunks, weights, params
        self.grad_wo = self.output_weight_grad(out)
        if self.queries_wait:  # dx is then made when the first KV block closes, dwq at the end
            self.waiting = self.wait_buffer()
        else:
            self.input_grad()
            if self.needs("wq"):
                self.grad_wq = self.layer.new_query_weight_grad(params.chunks)
        self.grad_wk, self.grad_wv = (
            accumulator(w, summed=params.chunks > 1).view(-1, params.head_dim, x.shape[-1])
            if self.needs(name)
            else None
            for w, name in ((weights.wk, "wk"), (weights.wv, "wv"))
        )

    def output_grad(self, i: int, stage: Stage) -> Tensor:
        """Chunk i's slice of the gradient before ``wo``, in the head layout."""
        rows = self.chunks.local[i]
        return self.chunks.spans[i].output_grad(self.grad_y[:, rows], self.weights.wo, stage)

    def _rows(self, tensor: Tensor | None, i: int) -> Tensor | None:
        return None if tensor is None else tensor[:, self.chunks.local[i]]

    def query(self, i: int, grad_q: Exchange, stage: Stage, rope: Tensor) -> None:
        span = self.chunks.spans[i]
        span.store_query_grad(
            grad_q,
            stage,
            rope,
            self._rows(self.waiting, i),
            self._rows(self.grad_x, i),
            self.grad_wq,
        )

    def kv(self, j: int, grad_k: Tensor, grad_v: Tensor, block: int, rope: Tensor) -> None:
        self.input_grad()
        self.chunks.spans[j].kv_backward(
            grad_k, grad_v, block, rope, self._rows(self.grad_x, j), self.grad_wk, self.grad_wv
        )

    def finish(self) -> tuple[Tensor | None, AttentionWeights]:
        if self.waiting is not None:  # the queries' one product runs over the whole shard
            whole = AttentionProjections(self.x, self.weights, self.params, self.layer.qk)
            self.finish_queries(whole)
        return self.result(self.weights)


def fpdt_backward(
    grad_y: Tensor,
    x: Tensor,
    weights: AttentionWeights,
    rope: Tensor,
    doc_ids: Tensor | None,
    out: Tensor,
    lse: Tensor,
    params: AttentionParams,
) -> tuple[Tensor | None, AttentionWeights]:
    """The fused op's backward; returns (dx, the weights' gradients), None for those autograd
    does not ask for (``_Gradients``)."""
    layer = _fused_chunks(x, weights, params, doc_ids)
    grads = _Gradients(layer, x, weights, out, grad_y, params)
    backward_chunks(layer, grads, rope, doc_ids, grads.out, lse)
    return grads.finish()


_OP = AttentionOp("fpdt", fpdt_forward, fpdt_backward)


def fpdt_attention(
    x: Tensor,
    weights: AttentionWeights,
    rope: Tensor,
    doc_ids: Tensor | None,
    params: AttentionParams,
) -> Tensor:
    """Differentiable FPDT attention including the output projection ``weights.wo`` of a
    chunk-strided shard; see the module docstring. ``params.chunks`` sequence chunks;
    ``params.store_name`` names the host store (``runtime.host_store.named_host_store``) for
    parked chunks."""
    return _OP(x, weights, rope, doc_ids, params)


# --- the op-level entry: the chunk loop on given q, k, v --------------------------------------


def _given_chunks(
    q: Tensor, k: Tensor, v: Tensor, params: AttentionParams, doc_ids: Tensor | None
) -> _Chunks:
    return _Chunks(
        q, params, doc_ids, lambda rows: GivenQKV(q[:, rows], k[:, rows], v[:, rows], params)
    )


class _InputGradients:
    """Where the op-level entry's backward puts each final dQ_i (its rows and stage heads of dq)
    and each K/V chunk's dK, dV of a block (its rows and the block's heads of dk, dv), in the
    inputs' layout."""

    queries = True

    def __init__(self, layer: _Chunks, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor) -> None:
        self.layer, self.grad_out = layer, grad_out
        self.grad_q = torch.empty_like(q)
        self.grad_k, self.grad_v = torch.empty_like(k), torch.empty_like(v)

    def output_grad(self, i: int, stage: Stage) -> Tensor:
        return self.layer.spans[i].output_grad(self.grad_out[:, self.layer.local[i]], stage)

    def query(self, i: int, grad_q: Exchange, stage: Stage, rope: None) -> None:
        rows = self.layer.local[i]
        self.layer.spans[i].write_stage(self.grad_q[:, rows], stage, grad_q.result())

    def kv(self, j: int, grad_k: Tensor, grad_v: Tensor, block: int, rope: None) -> None:
        span, rows = self.layer.spans[j], self.layer.local[j]
        heads = span.block_heads(block)
        for grad_h, target in ((grad_k, self.grad_k), (grad_v, self.grad_v)):
            target[:, rows, heads] = span.kv_grad(grad_h, target.dtype)


def fpdt_qkv_forward(
    q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None, params: AttentionParams
) -> tuple[Tensor, Tensor, Tensor]:
    """The op-level entry's forward: (out (B, L, H, d), lse (B, H, L), lse of each stage)."""
    layer = _given_chunks(q, k, v, params, doc_ids)
    out, lse = forward_chunks(layer, None, doc_ids)
    whole = lse.new_empty(q.shape[0], q.shape[1], q.shape[2], 1)
    for i, span in enumerate(layer.spans):
        for index, stage in enumerate(layer.schedule.stages):
            span.write_lse(whole[:, layer.local[i]], stage, lse[index, :, :, layer.gathered[i]])
    return out, whole.squeeze(-1).transpose(1, 2).contiguous(), lse


def fpdt_qkv_backward(
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
    layer = _given_chunks(q, k, v, params, doc_ids)
    grads = _InputGradients(layer, q, k, v, grad_out)
    backward_chunks(layer, grads, None, doc_ids, out, lse)
    return grads.grad_q, grads.grad_k, grads.grad_v


_QKV_OP = QKVAttentionOp("fpdt_qkv_attention", fpdt_qkv_forward, fpdt_qkv_backward)


def fpdt_qkv_attention(
    q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None, params: AttentionParams
) -> tuple[Tensor, Tensor]:
    """``fpdt_attention`` on given q, k, v (already rotated) of a chunk-strided shard: (out
    (B, S/C, H, d), lse (B, H, S/C), no gradient) (``ContextParallelAttention.attention`` is
    the public entry)."""
    return _QKV_OP(q, k, v, doc_ids, params)
