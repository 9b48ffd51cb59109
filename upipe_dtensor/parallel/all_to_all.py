"""Sequence <-> head all-to-all over one process group (one dimension of a DeviceMesh).

Ulysses layout change: a rank holding its contiguous sequence shard for all heads trades it for
the whole sequence of its share of the heads, and back. ``start_*`` begin an exchange and return
an ``Exchange`` to wait on later (the staged op overlaps the next stage's exchanges with this
stage's attention); the plain functions wait at once. They are what the UPipe op calls inside
its (eager) stage loop; ``seq_to_head`` / ``head_to_seq`` below are the same
exchange as differentiable custom ops with fake implementations, so other attention styles can
use them inside ``torch.compile(fullgraph=True)``. Works with gloo (CPU) and NCCL (CUDA).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group


class Exchange:
    """An all-to-all on its way: ``result()`` waits for it and returns the tensor in its new
    layout. Started exchanges run while the caller computes (NCCL on its own stream, gloo on its
    worker threads), so a stage's exchange can fly during the previous stage's attention. The
    send buffer stays referenced until the exchange is waited for: the library reads it
    meanwhile. ``result()`` is taken once and lets go of both buffers, so what the caller frees
    is freed, however long it keeps the exchange."""

    def __init__(
        self,
        send: Tensor,
        recv: Tensor,
        work: dist.Work | None,
        arrange: Callable[[Tensor], Tensor],
    ) -> None:
        self._send, self._recv, self._work, self._arrange = send, recv, work, arrange

    @classmethod
    def done(cls, x: Tensor) -> Exchange:
        """Nothing to exchange (a head axis of one rank): the result is ``x`` itself."""
        return cls(x, x, None, lambda t: t)

    def result(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        recv, self._send, self._recv = self._recv, None, None
        return self._arrange(recv)


def _start(send: Tensor, group: dist.ProcessGroup | None, arrange) -> Exchange:
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return Exchange(send, recv, work, arrange)


def start_sequence_to_heads(
    x: Tensor, group: dist.ProcessGroup | None, head_degree: int
) -> Exchange:
    """Start (B, S/C, h, d) local shard of all h heads -> (B, S, h/C, d), this rank's heads.

    Rank r receives head slice r of every peer; the sequence is the peers' shards in rank order.
    """
    if head_degree == 1:
        return Exchange.done(x)
    batch, local_len, heads, head_dim = x.shape
    send = x.reshape(batch, local_len, head_degree, heads // head_degree, head_dim)
    send = send.permute(2, 0, 1, 3, 4).contiguous()

    def arrange(recv: Tensor) -> Tensor:
        # recv[j] is peer j's sequence shard: put the peer axis next to the sequence axis.
        return recv.permute(1, 0, 2, 3, 4).reshape(
            batch, head_degree * local_len, heads // head_degree, head_dim
        )

    return _start(send, group, arrange)


def start_heads_to_sequence(
    x: Tensor, group: dist.ProcessGroup | None, head_degree: int
) -> Exchange:
    """Start (B, S, h, d) whole sequence of this rank's heads -> (B, S/C, h*C, d), all heads."""
    if head_degree == 1:
        return Exchange.done(x)
    batch, seq_len, heads, head_dim = x.shape
    send = x.reshape(batch, head_degree, seq_len // head_degree, heads, head_dim)
    send = send.transpose(0, 1).contiguous()

    def arrange(recv: Tensor) -> Tensor:
        # recv[j] holds peer j's heads for this rank's shard: heads of peer j come j-th.
        return recv.permute(1, 2, 0, 3, 4).reshape(
            batch, seq_len // head_degree, head_degree * heads, head_dim
        )

    return _start(send, group, arrange)


def sequence_to_heads(x: Tensor, group: dist.ProcessGroup | None, head_degree: int) -> Tensor:
    """``start_sequence_to_heads``, waited for."""
    return start_sequence_to_heads(x, group, head_degree).result()


def heads_to_sequence(x: Tensor, group: dist.ProcessGroup | None, head_degree: int) -> Tensor:
    """``start_heads_to_sequence``, waited for."""
    return start_heads_to_sequence(x, group, head_degree).result()


def _group(group_name: str) -> dist.ProcessGroup:
    return _resolve_process_group(group_name)


@torch.library.custom_op("upipe::seq_to_head", mutates_args=())
def seq_to_head(x: Tensor, group_name: str, head_degree: int) -> Tensor:
    """Differentiable, compile-friendly ``sequence_to_heads`` (the group is named by its string)."""
    out = sequence_to_heads(x, _group(group_name), head_degree)
    return out.clone() if out is x else out


@torch.library.custom_op("upipe::head_to_seq", mutates_args=())
def head_to_seq(x: Tensor, group_name: str, head_degree: int) -> Tensor:
    """Differentiable, compile-friendly ``heads_to_sequence``."""
    out = heads_to_sequence(x, _group(group_name), head_degree)
    return out.clone() if out is x else out


@seq_to_head.register_fake
def _(x: Tensor, group_name: str, head_degree: int) -> Tensor:
    batch, local_len, heads, head_dim = x.shape
    return x.new_empty(batch, local_len * head_degree, heads // head_degree, head_dim)


@head_to_seq.register_fake
def _(x: Tensor, group_name: str, head_degree: int) -> Tensor:
    batch, seq_len, heads, head_dim = x.shape
    return x.new_empty(batch, seq_len // head_degree, heads * head_degree, head_dim)


def _save_group(ctx, inputs, output) -> None:
    _, ctx.group_name, ctx.head_degree = inputs


def _seq_to_head_backward(ctx, grad: Tensor):
    return head_to_seq(grad, ctx.group_name, ctx.head_degree), None, None


def _head_to_seq_backward(ctx, grad: Tensor):
    return seq_to_head(grad, ctx.group_name, ctx.head_degree), None, None


seq_to_head.register_autograd(_seq_to_head_backward, setup_context=_save_group)
head_to_seq.register_autograd(_head_to_seq_backward, setup_context=_save_group)
