"""A tiny forward and backward of an attention backend, checked against float32 math, before a job
accepts the backend.

A backend can import and still not run: torch's FA3 wrapper calls ``flash_attn_3.fwd`` with the
34 arguments of flash-attention's HEAD, which FA3 builds of other vintages do not take, and
flash-attn 2.8.3's wheel ships an old ``flash_attn/cute/interface.py`` in the folder the
``flash-attn-4`` package installs into. Such a backend fails (or answers wrongly) at its first
call, after the job has started. So ``kernels.backends.choose_backend`` runs this probe on the GPU
for each candidate, named or tried by ``auto``: batch 1, 128 tokens, the model's head_dim and
compute dtype, two query heads per KV head, causal, and two documents in one varlen call when the
job masks documents; through the same ``kernels.attention`` calls the styles make, with the
backend activated (FA3/FA4 take over aten's flash ops) and the previous kernels restored after.
The output, the LSE and the three gradients must be finite and match float32 math to bf16
accuracy. It runs in milliseconds, once per backend and shape per process.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from upipe_dtensor.kernels.attention import attention_backward, attention_forward
from upipe_dtensor.kernels.flash_registry import activate_backend

TOKENS, QUERY_HEADS, KV_HEADS = 128, 2, 1
TOLERANCE = 0.05
"""Largest error relative to the reference's largest magnitude: bf16 rounds at 2^-8, and a
wrong layout or argument order is off by order one."""


@functools.cache
def probe_problem(backend: str, head_dim: int, dtype: torch.dtype, documents: bool) -> str:
    """Why ``backend`` fails the probe on this process's GPU ("" when it passes)."""
    from torch.nn.attention import current_flash_attention_impl, restore_flash_attention_impl

    previous = current_flash_attention_impl()
    try:
        activate_backend(backend)
        device = torch.device("cuda", torch.cuda.current_device())
        problem = run_probe(backend, device, head_dim, dtype, documents)
        torch.cuda.synchronize(device)  # an asynchronous kernel error surfaces here
    except Exception as err:  # any failure is the answer: the backend does not run here
        problem = f"{type(err).__name__}: {err}"
    finally:
        if previous is None:
            restore_flash_attention_impl()
        else:
            activate_backend(previous.lower())
    return f"fails a forward+backward probe ({problem})" if problem else ""


def run_probe(
    kernel: str, device: torch.device, head_dim: int, dtype: torch.dtype, documents: bool
) -> str:
    """Run ``kernel`` (``op_kernel``'s answer: a backend on CUDA, "cpu" on the CPU) once forward
    and backward on ``device``; "" when it matches float32 math, else what differs."""
    generator = torch.Generator().manual_seed(0)

    def draw(heads: int) -> Tensor:
        x = torch.randn(1, TOKENS, heads, head_dim, generator=generator)
        return x.to(device=device, dtype=dtype).requires_grad_()

    q, k, v = draw(QUERY_HEADS), draw(KV_HEADS), draw(KV_HEADS)
    grad_out = torch.randn(1, TOKENS, QUERY_HEADS, head_dim, generator=generator).to(device, dtype)
    docs = torch.tensor([[0] * (TOKENS // 2) + [1] * (TOKENS // 2)]) if documents else None
    scale = head_dim**-0.5
    with torch.no_grad():
        out, lse = attention_forward(q, k, v, scale, kernel, q_docs=docs, k_docs=docs)
        grads = attention_backward(
            grad_out, q, k, v, out, lse, scale, kernel, q_docs=docs, k_docs=docs
        )
    ref_out, ref_lse = _reference(q, k, v, scale, docs)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), grad_out.float())
    results = {"out": (out, ref_out), "lse": (lse, ref_lse)}
    results.update({f"d{n}": pair for n, pair in zip("qkv", zip(grads, ref_grads))})
    for name, (got, want) in results.items():
        if got.shape != want.shape:
            return f"{name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        error = (got.float() - want.detach()).abs().max() / want.detach().abs().max()
        if not torch.isfinite(error) or error > TOLERANCE:
            return f"{name} is off by {error:.2g} of its magnitude"
    return ""


def _reference(q: Tensor, k: Tensor, v: Tensor, scale: float, docs: Tensor | None):
    """Causal (document-masked) attention in float32: (out (B,S,h,d), lse (B,h,S))."""
    repeat = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(repeat, 1), vf.repeat_interleave(repeat, 1)
    scores = qf @ kf.transpose(-1, -2) * scale
    visible = torch.ones(TOKENS, TOKENS, dtype=torch.bool, device=q.device).tril()
    if docs is not None:
        same = docs.to(q.device)[0]
        visible &= same[:, None] == same[None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = scores.logsumexp(-1)
    out = (scores - lse[..., None]).exp() @ vf
    return out.transpose(1, 2), lse
