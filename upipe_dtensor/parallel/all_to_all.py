"""Sequence <-> head all-to-all over one process group (one dimension of a DeviceMesh).

Ulysses layout change: a rank holding its contiguous sequence shard for all heads trades it for
the whole sequence of its share of the heads, and back. ``start_*`` begin an exchange and return
an ``Exchange`` to wait on later: the Ulysses-family ops (``projections``, under the staged and
FPDT ops) overlap the next stage's exchanges with this stage's attention. They run inside the
attention custom op (``attention_op``), which compile sees as one opaque node, so they need no
fake implementation of their own. Works with gloo (CPU) and NCCL (CUDA).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from upipe_dtensor.runtime.fake_process_group import fill_as_received
from upipe_dtensor.runtime.torch_private import resolve_process_group


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


Arrange = Callable[[Tensor], Tensor]
"""What turns an exchange's receive buffer into the tensor in its new layout."""


def start_exchange(send: Tensor, arrange: Arrange, group: dist.ProcessGroup | None) -> Exchange:
    """Start the all-to-all of ``send`` (in send layout: peer axis first, contiguous)."""
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    fill_as_received((recv,), (send,), group)  # a stand-in run's fake group: finite data
    return Exchange(send, recv, work, arrange)


def sequence_to_heads(x: Tensor, head_degree: int) -> tuple[Tensor, Arrange]:
    """(send, arrange) of the (B, S/C, h, d) local shard of all h heads -> (B, S, h/C, d), this
    rank's heads. Rank r receives head slice r of every peer; the sequence is the peers' shards
    in rank order. ``send`` is a copy of ``x`` unless that is already its layout, so a caller
    that lets go of ``x`` before the exchange starts holds one tensor fewer at its peak."""
    batch, local_len, heads, head_dim = x.shape
    send = x.reshape(batch, local_len, head_degree, heads // head_degree, head_dim)
    send = send.permute(2, 0, 1, 3, 4).contiguous()

    def arrange(recv: Tensor) -> Tensor:
        # recv[j] is peer j's sequence shard: put the peer axis next to the sequence axis.
        return recv.permute(1, 0, 2, 3, 4).reshape(
            batch, head_degree * local_len, heads // head_degree, head_dim
        )

    return send, arrange


def heads_to_sequence(x: Tensor, head_degree: int) -> tuple[Tensor, Arrange]:
    """(send, arrange) of the (B, S, h, d) whole sequence of this rank's heads ->
    (B, S/C, h*C, d), all heads; as ``sequence_to_heads``."""
    batch, seq_len, heads, head_dim = x.shape
    send = x.reshape(batch, head_degree, seq_len // head_degree, heads, head_dim)
    send = send.transpose(0, 1).contiguous()

    def arrange(recv: Tensor) -> Tensor:
        # recv[j] holds peer j's heads for this rank's shard: heads of peer j come j-th.
        return recv.permute(1, 2, 0, 3, 4).reshape(
            batch, seq_len // head_degree, head_degree * heads, head_dim
        )

    return send, arrange


def start_sequence_to_heads(
    x: Tensor, group: dist.ProcessGroup | None, head_degree: int
) -> Exchange:
    """Start (B, S/C, h, d) local shard of all h heads -> (B, S, h/C, d), this rank's heads
    (``sequence_to_heads``)."""
    if head_degree == 1:
        return Exchange.done(x)
    return start_exchange(*sequence_to_heads(x, head_degree), group)


def start_heads_to_sequence(
    x: Tensor, group: dist.ProcessGroup | None, head_degree: int
) -> Exchange:
    """Start (B, S, h, d) whole sequence of this rank's heads -> (B, S/C, h*C, d), all heads
    (``heads_to_sequence``)."""
    if head_degree == 1:
        return Exchange.done(x)
    return start_exchange(*heads_to_sequence(x, head_degree), group)


def _group(group_name: str) -> dist.ProcessGroup:
    """The process group a custom op's string argument names (``head_stages.resolve_group``)."""
    return resolve_process_group(group_name)
