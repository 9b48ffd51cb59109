"""What a CUDA attention backward allocates inside, held while the memory planner traces it.

aten's CUDA attention ops have meta kernels, which return only their outputs: on the planner's
fake tensors the buffers a kernel allocates for itself would go uncounted. ``kernels.attention``
enters each CUDA backward through ``backward_workspace_held``, the one place the planner's
accounting enters the kernels: on fake tensors it allocates the kernel's workspace
(``cuda_backward_workspace_bytes``) for the call's duration, as CUDA holds it; on real tensors it
does nothing, since the kernel allocates its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from upipe_dtensor.kernels.flash_registry import REGISTRY_IMPLS
from upipe_dtensor.runtime.torch_private import is_fake


def round_up(value: int, multiple: int) -> int:
    """``value`` padded to a multiple of ``multiple``: the CUDA attention kernels' padded sizes
    (rows of 128, head dims and LSE columns of 32)."""
    return -(-value // multiple) * multiple


def cuda_backward_workspace_bytes(q: Tensor, k: Tensor, kernel: str) -> int:
    """Bytes a CUDA backward allocates besides its outputs, for (B, S, h, d) ``q`` and ``k``.
    Meta kernels return only the outputs, so the planner allocates this for the call's duration.

    FlashAttention-2 (``mha_bwd`` in csrc/flash_attn/flash_api.cpp, flash-attn's and aten's copy
    alike): a float32 dQ accumulator (B, round128(Sq), hq, round32(d)) and softmax_d (B, hq,
    round128(Sq)); with GQA, dK and dV expanded to every query head (2 x (B, Sk, hq, d) in the
    input dtype) before being summed. FA3 (hopper/flash_api.cpp ``mha_bwd``) and FA4
    (flash_attn/cute/interface.py ``_flash_attn_bwd``): the float32 dQ accumulator, softmax_d and
    a log2 LSE (B, hq, round128(Sq)) each, and with GQA float32 dK and dV accumulators per KV
    head (2 x (B, hk, round128(Sk) x round32(d))). cuDNN's and the memory-efficient kernel's
    internal workspaces are not modelled (their sizes are not documented); their K/V are repeated
    to the query heads in activation space, which is traced."""
    if kernel not in ("flash", "sdpa", *REGISTRY_IMPLS) or q.dtype == torch.float32:
        return 0
    batch, seq_q, heads, head_dim = q.shape
    kv_heads, rows, width = k.shape[2], round_up(seq_q, 128), round_up(head_dim, 32)
    dq_accum = batch * rows * heads * width * 4
    if kernel in REGISTRY_IMPLS:
        kv_accum = 2 * batch * kv_heads * round_up(k.shape[1], 128) * width * 4
        return dq_accum + 2 * batch * heads * rows * 4 + (kv_accum if kv_heads != heads else 0)
    expanded = 2 * batch * k.shape[1] * heads * head_dim * q.element_size()
    return dq_accum + batch * heads * rows * 4 + (expanded if kv_heads != heads else 0)


@contextlib.contextmanager
def backward_workspace_held(q: Tensor, k: Tensor, kernel: str) -> Iterator[None]:
    """Around one backward kernel call: on fake tensors of a CUDA kernel (the planner's trace),
    its workspace is held through the call, as CUDA holds it; otherwise nothing (a real kernel
    allocates its own; the CPU kernel has none)."""
    if kernel == "cpu" or not is_fake(q):
        yield
        return
    workspace = q.new_empty(cuda_backward_workspace_bytes(q, k, kernel), dtype=torch.uint8)
    try:
        yield
    finally:
        del workspace
