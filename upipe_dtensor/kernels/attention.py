"""Local causal attention for one UPipe stage: forward returns the log-sum-exp, backward reuses it.

A stage in backward is recomputed up to Q/K/V and then differentiated with the saved output and
LSE, so every backend here exposes the kernel-level pair (forward -> out, lse; backward(out, lse)
-> dq, dk, dv) rather than an autograd function. Tensors are (batch, seq, heads, head_dim); K/V may
have fewer heads than Q (GQA: query head i uses KV head i // (hq // hk)). LSE is (batch, hq, seq),
float32.

Backends: ``flash`` (flash-attn 2, CUDA), ``sdpa`` (PyTorch's own flash kernels: the CPU one, which
takes GQA as is, or the CUDA one, which gets K/V repeated to the query heads and whose backward
recomputes the stage's attention forward), ``auto`` = flash when
importable on CUDA, else sdpa. These run inside the UPipe
custom op, whose fake implementation is what ``torch.compile`` sees.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

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


def _repeat_kv(kv: Tensor, n_rep: int) -> Tensor:
    return kv if n_rep == 1 else kv.repeat_interleave(n_rep, dim=2)


def _sum_kv_grad(grad: Tensor, n_rep: int) -> Tensor:
    return grad if n_rep == 1 else grad.unflatten(2, (-1, n_rep)).sum(3)


def attention_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, backend: str
) -> tuple[Tensor, Tensor]:
    """Causal attention of q over k, v; returns (out (B,S,hq,d), lse (B,hq,S) float32)."""
    if backend == "flash":
        from flash_attn.flash_attn_interface import _flash_attn_forward

        out, lse, _, _ = _flash_attn_forward(
            q, k, v, 0.0, scale, True, -1, -1, 0.0, None, False
        )
        return out, lse
    if q.is_cuda:
        n_rep = q.shape[2] // k.shape[2]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)))
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            qt, kt, vt, 0.0, True, False, scale=scale
        )
    else:  # the CPU kernel takes fewer KV heads as they are
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True, scale=scale
        )
    return out.transpose(1, 2), lse


def attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of causal attention w.r.t. q, k, v, from the forward's out and lse."""
    if backend == "flash":
        from flash_attn.flash_attn_interface import _flash_attn_backward

        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(
            grad_out.contiguous(), q, k, v, out.contiguous(), lse, dq, dk, dv,
            0.0, scale, True, -1, -1, 0.0, None, False,
        )
        return dq, dk, dv
    if not q.is_cuda:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(t.transpose(1, 2) for t in (grad_out, q, k, v, out)), lse, 0.0, True, scale=scale
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    # The CUDA SDPA flash backward needs forward-only bookkeeping tensors that cannot cross the
    # stage boundary, so this path differentiates a recomputed stage instead.
    n_rep = q.shape[2] // k.shape[2]
    with torch.enable_grad():
        leaves = [
            t.detach().transpose(1, 2).requires_grad_()
            for t in (q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep))
        ]
        recomputed = torch.nn.functional.scaled_dot_product_attention(
            *leaves, is_causal=True, scale=scale
        )
        dq, dk, dv = torch.autograd.grad(recomputed, leaves, grad_out.transpose(1, 2))
    dq, dk, dv = (t.transpose(1, 2) for t in (dq, dk, dv))
    return dq, _sum_kv_grad(dk, n_rep), _sum_kv_grad(dv, n_rep)
