"""Local attention kernels with one contract for every CP style: forward -> (out, lse); backward
from (out, lse).

Every style runs attention as blocks of queries against blocks of keys and either finishes a block
in one call (UPipe, Ulysses) or merges several blocks through their log-sum-exp (ring, FPDT; see
``kernels.merge``). Backward then differentiates each block with the *final* output and LSE, which
gives the exact gradient of the merged attention, so nothing but (out, lse) crosses a block.

A block is one of two kinds, which is all the causal mask needs when tokens keep their global
order inside every block:
  ``causal=True``  the queries and keys are the same tokens (a diagonal block): key j is visible
                   to query i iff j <= i;
  ``causal=False`` every key precedes every query (a past block): all keys are visible.
With documents (``q_docs``, ``k_docs``: (B, Sq), (B, Sk) int document ids, non-decreasing along
the sequence, as ``documents.document_ids`` numbers them) keys of other documents are hidden too.
In a past block at most one document has both keys and queries (documents are contiguous): a
prefix of the queries against a suffix of the keys; queries with no visible key get out = 0 and
lse = -inf, which the LSE merge treats as "no contribution".

Tensors are (batch, seq, heads, head_dim); K/V may have fewer heads than Q (GQA: query head i uses
KV head i // (hq // hk)). LSE is (batch, hq, seq) float32.

Backends: ``flash`` (flash-attn 2 on CUDA; documents through its varlen kernels), ``sdpa``
(PyTorch's own flash kernels: the CPU one, or aten's CUDA flash forward/backward, which take the
saved output and LSE like flash-attn; documents run one document at a time there), ``auto`` =
flash when importable on CUDA, else sdpa. The CUDA paths are thin calls of documented library
functions and have not been run in this repository (no GPU); the CPU path runs the same block
logic and is what the tests check against the unsharded model.

On fake tensors (the memory planner) document ids have no values, so a document-masked block is
planned as the dense block of the same shapes: the kernels' outputs are the same size either way
and the boundary metadata is a few integers per document.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

BACKENDS = ("auto", "flash", "sdpa")


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def resolve_backend(name: str, device: torch.device) -> str:
    """The concrete backend for ``name`` on ``device``; ValueError if it cannot run there."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    if name == "auto":
        return "flash" if device.type == "cuda" and flash_attn_available() else "sdpa"
    if name == "flash" and not (device.type == "cuda" and flash_attn_available()):
        raise ValueError(
            "attention backend 'flash' needs CUDA tensors and the flash-attn package "
            "(pip install 'upipe-dtensor[flash]'); use backend='sdpa' or 'auto'"
        )
    return name


# --- what the CUDA kernels allocate inside, for the memory planner --------------------------------

_PLANNED_CUDA_BACKEND: str | None = None


@contextlib.contextmanager
def planning_cuda_workspaces(backend: str = "flash") -> Iterator[None]:
    """The memory planner runs the CPU kernels on fake tensors for a GPU job; inside this context
    every backward call also allocates, for the duration of the call, the workspace the CUDA kernel
    allocates internally (see ``cuda_backward_workspace_bytes``)."""
    global _PLANNED_CUDA_BACKEND
    previous, _PLANNED_CUDA_BACKEND = _PLANNED_CUDA_BACKEND, backend
    try:
        yield
    finally:
        _PLANNED_CUDA_BACKEND = previous


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def cuda_backward_workspace_bytes(q: Tensor, k: Tensor, backend: str) -> int:
    """Bytes flash-attn 2's backward (``mha_bwd`` in csrc/flash_attn/flash_api.cpp, also aten's
    copy of it) allocates besides its outputs: a float32 dQ accumulator (B, round128(Sq), hq,
    round32(d)) and softmax_d (B, hq, round128(Sq)); with GQA, flash-attn expands dK and dV to
    every query head (2 x (B, Sk, hq, d) in the input dtype) before summing them. The aten path
    gets K/V already repeated to the query heads, so it has no expansion."""
    batch, seq_q, heads, head_dim = q.shape
    rows = _round_up(seq_q, 128)
    workspace = batch * rows * heads * _round_up(head_dim, 32) * 4 + batch * heads * rows * 4
    if backend == "flash" and k.shape[2] != heads:
        workspace += 2 * batch * k.shape[1] * heads * head_dim * q.element_size()
    return workspace


# --- dense blocks: one kernel call -------------------------------------------------------------


def _repeat_kv(kv: Tensor, n_rep: int) -> Tensor:
    return kv if n_rep == 1 else kv.repeat_interleave(n_rep, dim=2)


def _sum_kv_grad(grad: Tensor, n_rep: int) -> Tensor:
    return grad if n_rep == 1 else grad.unflatten(2, (-1, n_rep)).sum(3)


def _philox_placeholder(device: torch.device) -> Tensor:
    """aten's flash backward takes the forward's dropout RNG state; without dropout it is unused."""
    return torch.empty(2, dtype=torch.int64, device=device)


def _dense_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, backend: str, causal: bool):
    if backend == "flash":
        from flash_attn.flash_attn_interface import _flash_attn_forward

        out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, scale, causal, -1, -1, 0.0, None, False)
        return out, lse
    if q.is_cuda:  # aten's flash kernel: (B, S, h, d) in and out; K/V repeated to the query heads
        n_rep = q.shape[2] // k.shape[2]
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q,
            _repeat_kv(k, n_rep),
            _repeat_kv(v, n_rep),
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            False,
            scale=scale,
        )
        return out, lse
    # The CPU kernel takes grouped K/V as they are.
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale
    )
    return out.transpose(1, 2), lse


def _dense_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    backend: str,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    if _PLANNED_CUDA_BACKEND is not None:  # held through the call, as the CUDA kernel holds it
        workspace = q.new_empty(
            cuda_backward_workspace_bytes(q, k, _PLANNED_CUDA_BACKEND), dtype=torch.uint8
        )
        grads = _kernel_backward(grad_out, q, k, v, out, lse, scale, backend, causal)
        del workspace
        return grads
    return _kernel_backward(grad_out, q, k, v, out, lse, scale, backend, causal)


def _kernel_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    backend: str,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    if backend == "flash":
        from flash_attn.flash_attn_interface import _flash_attn_backward

        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(
            grad_out.contiguous(),
            q,
            k,
            v,
            out.contiguous(),
            lse.contiguous(),
            dq,
            dk,
            dv,
            0.0,
            scale,
            causal,
            -1,
            -1,
            0.0,
            None,
            False,
        )
        return dq, dk, dv
    if q.is_cuda:
        n_rep = q.shape[2] // k.shape[2]
        rng = _philox_placeholder(q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(),
            q,
            _repeat_kv(k, n_rep),
            _repeat_kv(v, n_rep),
            out.contiguous(),
            lse.contiguous(),
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            rng,
            rng,
            scale=scale,
        )
        return dq, _sum_kv_grad(dk, n_rep), _sum_kv_grad(dv, n_rep)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(t.transpose(1, 2) for t in (grad_out, q, k, v, out)),
        lse.contiguous(),
        0.0,
        causal,
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# --- document-masked blocks ----------------------------------------------------------------------


def _documents_given(q: Tensor, q_docs: Tensor | None, k_docs: Tensor | None) -> bool:
    if (q_docs is None) != (k_docs is None):
        raise ValueError("pass both q_docs and k_docs, or neither")
    return q_docs is not None and not (is_fake(q_docs) or is_fake(q))


def _segments(docs: Tensor) -> list[list[tuple[int, int]]]:
    """[start, end) of every document, per batch row (only the change points go to the host)."""
    rows = []
    length = docs.shape[1]
    for row in docs:
        cuts = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
        bounds = [0, *cuts, length]
        rows.append(list(zip(bounds[:-1], bounds[1:])))
    return rows


def _shared_document(q_docs: Tensor, k_docs: Tensor) -> list[tuple[int, int]]:
    """Per row of a past block: (queries, keys) = the query prefix and key suffix of the one
    document that has both, or (0, 0)."""
    common = k_docs[:, -1:]
    queries = (q_docs == common).sum(1) * (q_docs[:, :1] == common).squeeze(1)
    keys = (k_docs == common).sum(1) * (queries > 0)
    return list(zip(queries.tolist(), keys.tolist()))


def _varlen_seqlens(
    segments: list[list[tuple[int, int]]], length: int, device
) -> tuple[Tensor, int]:
    """cu_seqlens over the batch packed row after row, and the longest document."""
    bounds = [row * length + start for row, spans in enumerate(segments) for start, _ in spans]
    bounds.append(len(segments) * length)
    longest = max(end - start for spans in segments for start, end in spans)
    return torch.tensor(bounds, dtype=torch.int32, device=device), longest


def _flash_varlen_forward(q, k, v, scale, segments):
    from flash_attn.flash_attn_interface import _flash_attn_varlen_forward

    batch, length, heads, _ = q.shape
    cu, longest = _varlen_seqlens(segments, length, q.device)
    out, lse, *_ = _flash_attn_varlen_forward(
        *(t.flatten(0, 1) for t in (q, k, v)),
        cu,
        cu,
        longest,
        longest,
        0.0,
        scale,
        True,
    )
    # flash-attn's varlen LSE is (heads, total tokens): back to (B, heads, S).
    return out.view_as(q), lse.view(heads, batch, length).transpose(0, 1)


def _flash_varlen_backward(grad_out, q, k, v, out, lse, scale, segments):
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

    cu, longest = _varlen_seqlens(segments, q.shape[1], q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_varlen_backward(
        *(t.flatten(0, 1) for t in (grad_out.contiguous(), q, k, v, out.contiguous())),
        lse.transpose(0, 1).flatten(1).contiguous(),
        *(t.flatten(0, 1) for t in (dq, dk, dv)),
        cu,
        cu,
        longest,
        longest,
        0.0,
        scale,
        True,
        -1,
        -1,
        0.0,
        None,
        False,
    )
    return dq, dk, dv


def _document_forward(q, k, v, scale, backend, causal, q_docs, k_docs):
    if causal:
        segments = _segments(q_docs)
        if backend == "flash":
            return _flash_varlen_forward(q, k, v, scale, segments)
        out, lse = (
            torch.empty_like(q),
            q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32),
        )
        for row, spans in enumerate(segments):
            for start, end in spans:
                o, lse_part = _dense_forward(
                    *(t[row : row + 1, start:end] for t in (q, k, v)), scale, backend, True
                )
                out[row : row + 1, start:end], lse[row : row + 1, :, start:end] = o, lse_part
        return out, lse
    out = torch.zeros_like(q)
    lse = torch.full(
        (q.shape[0], q.shape[2], q.shape[1]), -torch.inf, dtype=torch.float32, device=q.device
    )
    for row, (queries, keys) in enumerate(_shared_document(q_docs, k_docs)):
        if queries:
            o, lse_part = _dense_forward(
                q[row : row + 1, :queries],
                k[row : row + 1, -keys:],
                v[row : row + 1, -keys:],
                scale,
                backend,
                False,
            )
            out[row : row + 1, :queries], lse[row : row + 1, :, :queries] = o, lse_part
    return out, lse


def _document_backward(grad_out, q, k, v, out, lse, scale, backend, causal, q_docs, k_docs):
    if causal:
        segments = _segments(q_docs)
        if backend == "flash":
            return _flash_varlen_backward(grad_out, q, k, v, out, lse, scale, segments)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for row, spans in enumerate(segments):
            for start, end in spans:
                piece = (t[row : row + 1, start:end] for t in (grad_out, q, k, v, out))
                grads = _dense_backward(
                    *piece, lse[row : row + 1, :, start:end], scale, backend, True
                )
                for grad, target in zip(grads, (dq, dk, dv)):
                    target[row : row + 1, start:end] = grad
        return dq, dk, dv
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for row, (queries, keys) in enumerate(_shared_document(q_docs, k_docs)):
        if queries:
            rows = slice(row, row + 1)
            grads = _dense_backward(
                grad_out[rows, :queries],
                q[rows, :queries],
                k[rows, -keys:],
                v[rows, -keys:],
                out[rows, :queries],
                lse[rows, :, :queries],
                scale,
                backend,
                False,
            )
            dq[rows, :queries], dk[rows, -keys:], dv[rows, -keys:] = grads
    return dq, dk, dv


# --- the contract ------------------------------------------------------------------------------


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    backend: str,
    *,
    causal: bool = True,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of one block (module docstring); returns (out (B,Sq,hq,d), lse (B,hq,Sq)
    float32)."""
    if _documents_given(q, q_docs, k_docs):
        return _document_forward(q, k, v, scale, backend, causal, q_docs, k_docs)
    return _dense_forward(q, k, v, scale, backend, causal)


def attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    backend: str,
    *,
    causal: bool = True,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients w.r.t. q, k, v of one block, from the (final, merged) out and lse."""
    if _documents_given(q, q_docs, k_docs):
        return _document_backward(
            grad_out, q, k, v, out, lse, scale, backend, causal, q_docs, k_docs
        )
    return _dense_backward(grad_out, q, k, v, out, lse, scale, backend, causal)
