"""Sequence <-> head all-to-all over one process group (one dimension of a DeviceMesh).

Ulysses layout change: a rank holding its contiguous sequence shard for all heads trades it for
the whole sequence of its share of the heads, and back. ``start_*`` begin an exchange and return
an ``Exchange`` to wait on later: the Ulysses-family ops (``projections``, under the staged and
FPDT ops) overlap the next stage's exchanges with this stage's attention. They run inside the
attention custom op (``attention_op``), which compile sees as one opaque node, so they need no
fake implementation of their own. Works with gloo (CPU) and NCCL (CUDA).

On CPU an exchange's buffers are freed where the caller lets go of them, never later: gloo's
worker thread holds the all-to-all's tensors until it drops its work object, which it does
after ``wait`` has returned, so when the caller got on first (a busy core), the worker freed the
buffer later, while the caller was already allocating the next ones, and the layer's peak rose
by that buffer in some runs and not in others (issue 57: an 8 MiB send copy of the queries,
Ulysses at GQA 32/8/16/16K). gloo is therefore handed aliases of the two buffers that nothing
else holds, and ``Exchange.result`` waits until the worker has let go of them (a use count back
to the alias's own) before the caller's references go.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from upipe_dtensor.runtime.fake_process_group import fill_as_received
from upipe_dtensor.runtime.torch_private import resolve_process_group, tensor_use_count

RELEASE_TIMEOUT_S = 1.0
"""The longest ``Exchange.result`` waits for gloo's worker to let go of an exchange's buffers
(it takes microseconds; a core busy elsewhere may delay it some milliseconds)."""


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
        lent: tuple[Tensor, ...] = (),
    ) -> None:
        """``lent``: the aliases of the buffers the library holds (on CPU), to wait for."""
        self._send, self._recv, self._work, self._arrange = send, recv, work, arrange
        self._lent = lent

    @classmethod
    def done(cls, x: Tensor) -> Exchange:
        """Nothing to exchange (a head axis of one rank): the result is ``x`` itself."""
        return cls(x, x, None, lambda t: t)

    def result(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            _let_go(self._lent)
            self._lent = ()
        recv, self._send, self._recv = self._recv, None, None
        return self._arrange(recv)


def _let_go(lent: tuple[Tensor, ...]) -> None:
    """Wait until nothing but ``lent`` itself holds each alias: gloo's worker has dropped the
    work that held it (module docstring), so the buffers are freed where the caller frees them.
    At most ``RELEASE_TIMEOUT_S``."""
    deadline = None
    for alias in lent:
        while tensor_use_count(alias) > 1:
            now = time.monotonic()
            deadline = deadline or now + RELEASE_TIMEOUT_S
            if now > deadline:
                return
            os.sched_yield()


Arrange = Callable[[Tensor], Tensor]
"""What turns an exchange's receive buffer into the tensor in its new layout."""


def start_exchange(send: Tensor, arrange: Arrange, group: dist.ProcessGroup | None) -> Exchange:
    """Start the all-to-all of ``send`` (in send layout: peer axis first, contiguous)."""
    recv = torch.empty_like(send)
    cpu = send.device.type == "cpu"
    # On CPU (gloo) the library gets aliases that only it holds (the module docstring).
    lent = (recv.detach(), send.detach()) if cpu else (recv, send)
    work = dist.all_to_all_single(*lent, group=group, async_op=True)
    fill_as_received((recv,), (send,), group)  # a stand-in run's fake group: finite data
    return Exchange(send, recv, work, arrange, lent if cpu else ())


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
