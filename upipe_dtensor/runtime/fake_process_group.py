"""The fake process group: every rank of a job laid out in one process, collectives that move no
data. The planner (``planning.step``) runs a job's real step on it with fake tensors; the
stand-in run (``verify.stand_in``) runs it with real tensors on one device, as rank 0 of the job.

torch registers the ``"fake"`` backend, and defines the ``FakeStore`` it is initialised with, in
a private test module (``torch.testing._internal.distributed.fake_pg``): importing that module is
what makes ``init_process_group("fake")`` work. The package imports it in one place,
``runtime.torch_private.fake_store``, so a torch release that moves it breaks there, with a
message saying so, and not inside a plan.

What a fake collective leaves in its output (torch 2.11 and 2.13, read off CPU runs): an
all-gather copies the local shard into every chunk and an all-reduce keeps the local value, but
an all-to-all, a reduce-scatter and a receive leave their outputs as they were allocated, that
is uninitialised. With real tensors that is garbage that turns into NaN gradients and weights by
the second step, and NaN or constant data can make kernels draw less power, which flatters their
timings. Inside ``local_data_in_fake_collectives`` the exchanges this package makes fill their
outputs with the local data instead (``fill_as_received``: the all-to-all's and the ring's
receive buffers get what this rank sent; ``LocalReduceScatter``: FSDP2's gradient shards get
this rank's own chunk, not the sum over ranks), so every value stays finite and of the
magnitudes a real step has. A plan never turns it on: its fake tensors hold no data. The mode
lives in ``modes.fake_group``, with the planner's and the stand-in's other modes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from upipe_dtensor.modes.fake_group import filling
from upipe_dtensor.runtime.torch_private import fake_store


def init_fake_process_group(world_size: int) -> None:
    """Initialise the default process group as rank 0 of ``world_size`` fake ranks."""
    dist.init_process_group("fake", rank=0, world_size=world_size, store=fake_store())


def is_fake(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` (None: the default group) is a fake one."""
    return dist.get_backend(group) == "fake"


def fill_as_received(received: Sequence[Tensor], sent: Sequence[Tensor], group) -> None:
    """Where a stand-in run exchanges over a fake ``group``, copy each sent tensor into the
    buffer the exchange receives into (same shapes), as the real exchange would write there;
    elsewhere nothing."""
    if filling() and is_fake(group):
        for into, data in zip(received, sent, strict=True):
            into.copy_(data)


class LocalReduceScatter:
    """FSDP2's reduce-scatter for a stand-in run (``FSDPModule.set_custom_reduce_scatter``): this
    rank's chunk of the unsharded gradients, copied into its shard, where the real one writes the
    reduction over ranks. One copy kernel of the shard's size, where NCCL's kernel writes it."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group, op=None, async_op=False
    ) -> None:
        chunks = input_tensor.view(group.size(), -1)
        output_tensor.view(-1).copy_(chunks[group.rank()])


def keep_fsdp_gradients_finite(model: nn.Module) -> int:
    """Give every FSDP2 module of ``model`` the ``LocalReduceScatter``; returns how many."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_custom_reduce_scatter(LocalReduceScatter())
    return len(modules)
