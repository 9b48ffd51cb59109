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

Backends (``[parallelism] attention_backend``; ``kernels.backends`` chooses one) and the aten or
flash-attn calls they make here: ``fa3``, ``fa4`` and ``sdpa`` call aten's flash ops (16-bit;
grouped K/V as they are; documents through the varlen path, one launch per block), which torch's
flash-attention registry points at FA3's or FA4's kernels (``flash_registry.activate_backend``);
``sdpa`` in float32 calls aten's memory-efficient op; ``cudnn`` aten's cuDNN op (LSE (B, h, S, 1);
no document masks: refused when asked); ``flash`` the flash-attn package; on CPU the CPU flash op.
The kernel is chosen from the backend and the device the job runs on (``kernel_device``), never
from the tensors' device: aten's CUDA attention ops have meta kernels, so the memory planner and
the tests trace the CUDA branch on fake CPU tensors (fake ``cuda`` tensors would abort autograd in
a CPU-only build). The one thing that cannot run on fake tensors is flash-attn's compiled module:
there its twin, aten's copy of the same FlashAttention-2 kernels (same outputs, same LSE layouts),
is traced instead (``_uses_flash_attn``: a correctness need, not the planner's accounting). Meta
kernels return only their outputs, so a CUDA backward's own workspace enters the planner's count
at one call per backward (``kernels.traced_workspace.backward_workspace_held``, which does nothing
on real tensors). The other device-only pieces (streams, events, pinned memory) are in
``runtime/host_store.py``, whose CPU twin is the same code with plain copies.

Document boundaries (varlen ``cu_seqlens``, a past block's shared document) are computed once per
step per document-id tensor and sent to the device without a host sync
(``kernels.document_blocks``). Fake document ids (the memory planner's) describe one document per
row, so the planner traces the document path (varlen kernels included) with the shapes of the
dense blocks; with real document ids (the tests) it runs on their real boundaries.
"""

from __future__ import annotations

import torch
from torch import Tensor

from upipe_dtensor.kernels.document_blocks import segments as document_segments
from upipe_dtensor.kernels.document_blocks import shared_document, varlen_seqlens
from upipe_dtensor.kernels.flash_registry import REGISTRY_IMPLS
from upipe_dtensor.kernels.merge import accumulation_dtype
from upipe_dtensor.kernels.traced_workspace import backward_workspace_held, round_up
from upipe_dtensor.runtime.torch_private import is_fake

# --- dense blocks: one kernel call -------------------------------------------------------------


def _repeat_kv(kv: Tensor, n_rep: int) -> Tensor:
    return kv if n_rep == 1 else kv.repeat_interleave(n_rep, dim=2)


def _sum_kv_grad(grad: Tensor, n_rep: int) -> Tensor:
    return grad if n_rep == 1 else grad.unflatten(2, (-1, n_rep)).sum(3)


def _uses_flash_attn(q: Tensor, kernel: str) -> bool:
    """The flash-attn package runs real CUDA tensors; its compiled module cannot run fake ones
    (the planner's), so there its aten twin is traced: same kernels, outputs and LSE layouts."""
    return kernel == "flash" and not is_fake(q)


def _aten_kernel(q: Tensor, kernel: str) -> str:
    """Which aten CUDA op runs a block: flash (16-bit; also flash-attn's twin, and FA3's and
    FA4's, which torch's registry puts behind the same op), efficient (float32 under sdpa) or
    cudnn."""
    if kernel == "cudnn":
        return "cudnn"
    return "efficient" if q.dtype == torch.float32 else "flash"


def _dense_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, kernel: str, causal: bool):
    if kernel == "cpu":  # the CPU kernel takes grouped K/V as they are
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale
        )
        return out.transpose(1, 2), lse
    if _uses_flash_attn(q, kernel):
        from flash_attn.flash_attn_interface import _flash_attn_forward

        out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, scale, causal, -1, -1, 0.0, None, False)
        return out, lse
    aten, n_rep = _aten_kernel(q, kernel), q.shape[2] // k.shape[2]
    if aten == "flash":  # FlashAttention-2 handles grouped K/V itself: no repeat
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False, scale=scale
        )
        return out, lse
    # cuDNN and the memory-efficient kernel get K/V repeated to the query heads, (B, h, S, d).
    qt, kt, vt = (t.transpose(1, 2) for t in (q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)))
    if aten == "cudnn":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qt, kt, vt, None, True, 0.0, causal, False, scale=scale
        )
        return out.transpose(1, 2), lse.squeeze(-1)  # cuDNN's LSE is (B, h, S, 1)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        qt, kt, vt, None, True, 0.0, causal, scale=scale
    )
    return out.transpose(1, 2), lse[..., : q.shape[1]]  # its LSE rows are padded to 32


def _dense_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    kernel: str,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    with backward_workspace_held(q, k, kernel):  # the planner's count of the kernel's workspace
        return _kernel_backward(grad_out, q, k, v, out, lse, scale, kernel, causal)


def _kernel_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    kernel: str,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    grad_out, out, lse = grad_out.contiguous(), out.contiguous(), lse.contiguous()
    if kernel == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(t.transpose(1, 2) for t in (grad_out, q, k, v, out)), lse, 0.0, causal, scale=scale
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    if _uses_flash_attn(q, kernel):
        from flash_attn.flash_attn_interface import _flash_attn_backward

        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(
            grad_out, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal, -1, -1, 0.0, None, False
        )
        return dq, dk, dv
    aten, n_rep = _aten_kernel(q, kernel), q.shape[2] // k.shape[2]
    if aten == "flash":
        unused = torch.empty((), dtype=torch.uint64, device=q.device)  # no dropout: no RNG state
        return torch.ops.aten._flash_attention_backward(
            grad_out,
            q,
            k,
            v,
            out,
            lse,
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            unused,
            unused,
            scale=scale,
        )
    qt, kt, vt, gt, ot = (
        t.transpose(1, 2) for t in (q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep), grad_out, out)
    )
    seed = torch.empty((), dtype=torch.long, device=q.device)
    if aten == "cudnn":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            gt,
            qt,
            kt,
            vt,
            ot,
            lse.unsqueeze(-1),
            seed,
            seed,
            None,
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            scale=scale,
        )
    else:
        padded = lse.new_zeros(*lse.shape[:-1], round_up(lse.shape[-1], 32))
        padded[..., : lse.shape[-1]] = lse
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            gt,
            qt,
            kt,
            vt,
            None,
            ot,
            padded,
            seed,
            seed,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
    dq, dk, dv = (t.transpose(1, 2) for t in (dq, dk, dv))
    return dq, _sum_kv_grad(dk, n_rep), _sum_kv_grad(dv, n_rep)


# --- document-masked blocks ----------------------------------------------------------------------


def _documents_given(q_docs: Tensor | None, k_docs: Tensor | None) -> bool:
    if (q_docs is None) != (k_docs is None):
        raise ValueError("pass both q_docs and k_docs, or neither")
    return q_docs is not None


def _varlen_forward(q, k, v, scale, kernel, docs):
    """Every document of a diagonal block in one varlen launch (flash-attn's, or aten's flash)."""
    batch, length, heads, _ = q.shape
    cu, longest = varlen_seqlens(docs, q.device)
    flat = [t.flatten(0, 1) for t in (q, k, v)]
    if _uses_flash_attn(q, kernel):
        from flash_attn.flash_attn_interface import _flash_attn_varlen_forward

        out, lse, *_ = _flash_attn_varlen_forward(*flat, cu, cu, longest, longest, 0.0, scale, True)
    else:
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            *flat, cu, cu, longest, longest, 0.0, True, False, scale=scale
        )
    # The varlen LSE is (heads, total tokens): back to (B, heads, S).
    return out.view_as(q), lse.view(heads, batch, length).transpose(0, 1)


def _varlen_backward(grad_out, q, k, v, out, lse, scale, kernel, docs):
    cu, longest = varlen_seqlens(docs, q.device)
    flat = [t.flatten(0, 1) for t in (grad_out.contiguous(), q, k, v, out.contiguous())]
    flat_lse = lse.transpose(0, 1).flatten(1).contiguous()
    if not _uses_flash_attn(q, kernel):
        unused = torch.empty((), dtype=torch.uint64, device=q.device)
        # The varlen kernel's workspace: its rows are the packed documents, as many as the
        # dense block's.
        with backward_workspace_held(q, k, kernel):
            grads = torch.ops.aten._flash_attention_backward(
                *flat, flat_lse, cu, cu, longest, longest, 0.0, True, unused, unused, scale=scale
            )
        return tuple(g.view_as(t) for g, t in zip(grads, (q, k, v)))
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_varlen_backward(
        *flat,
        flat_lse,
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


def _has_varlen(q: Tensor, kernel: str) -> bool:
    """Kernels with a varlen path: flash-attn, FA3, FA4 and aten's flash (16-bit). The CPU kernel
    and float32's memory-efficient kernel run one document at a time."""
    return kernel in ("flash", *REGISTRY_IMPLS) or (kernel == "sdpa" and q.dtype != torch.float32)


def _document_forward(q, k, v, scale, kernel, causal, q_docs, k_docs):
    if kernel == "cudnn":
        raise ValueError(_CUDNN_DOCUMENTS)
    if causal:
        if _has_varlen(q, kernel):
            return _varlen_forward(q, k, v, scale, kernel, q_docs)
        segments = document_segments(q_docs)
        out, lse = (
            torch.empty_like(q),
            q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=accumulation_dtype(q.dtype)),
        )
        for row, spans in enumerate(segments):
            for start, end in spans:
                o, lse_part = _dense_forward(
                    *(t[row : row + 1, start:end] for t in (q, k, v)), scale, kernel, True
                )
                out[row : row + 1, start:end], lse[row : row + 1, :, start:end] = o, lse_part
        return out, lse
    out = torch.zeros_like(q)
    lse = torch.full(
        (q.shape[0], q.shape[2], q.shape[1]),
        -torch.inf,
        dtype=accumulation_dtype(q.dtype),
        device=q.device,
    )
    for row, (queries, keys) in enumerate(shared_document(q_docs, k_docs)):
        if queries:
            o, lse_part = _dense_forward(
                q[row : row + 1, :queries],
                k[row : row + 1, -keys:],
                v[row : row + 1, -keys:],
                scale,
                kernel,
                False,
            )
            out[row : row + 1, :queries], lse[row : row + 1, :, :queries] = o, lse_part
    return out, lse


def _document_backward(grad_out, q, k, v, out, lse, scale, kernel, causal, q_docs, k_docs):
    if kernel == "cudnn":
        raise ValueError(_CUDNN_DOCUMENTS)
    if causal:
        if _has_varlen(q, kernel):
            return _varlen_backward(grad_out, q, k, v, out, lse, scale, kernel, q_docs)
        segments = document_segments(q_docs)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for row, spans in enumerate(segments):
            for start, end in spans:
                piece = (t[row : row + 1, start:end] for t in (grad_out, q, k, v, out))
                grads = _dense_backward(
                    *piece, lse[row : row + 1, :, start:end], scale, kernel, True
                )
                for grad, target in zip(grads, (dq, dk, dv)):
                    target[row : row + 1, start:end] = grad
        return dq, dk, dv
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for row, (queries, keys) in enumerate(shared_document(q_docs, k_docs)):
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
                kernel,
                False,
            )
            dq[rows, :queries], dk[rows, -keys:], dv[rows, -keys:] = grads
    return dq, dk, dv


_CUDNN_DOCUMENTS = (
    "attention backend 'cudnn' cannot mask documents (aten's cuDNN op has no varlen path); "
    "use 'flash' or 'sdpa' with [training] attention_mask = 'document'"
)


# --- the contract ------------------------------------------------------------------------------


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    kernel: str,
    *,
    causal: bool = True,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of one block (module docstring); returns (out (B,Sq,hq,d), lse (B,hq,Sq)
    float32). ``kernel`` is ``op_kernel``'s answer."""
    if _documents_given(q_docs, k_docs):
        return _document_forward(q, k, v, scale, kernel, causal, q_docs, k_docs)
    return _dense_forward(q, k, v, scale, kernel, causal)


def attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    kernel: str,
    *,
    causal: bool = True,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients w.r.t. q, k, v of one block, from the (final, merged) out and lse."""
    if _documents_given(q_docs, k_docs):
        return _document_backward(
            grad_out, q, k, v, out, lse, scale, kernel, causal, q_docs, k_docs
        )
    return _dense_backward(grad_out, q, k, v, out, lse, scale, kernel, causal)
