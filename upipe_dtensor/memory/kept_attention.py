"""Attention kept from forward for backward's recompute (``[activation_checkpoint]
keep_attention``).

Full activation checkpointing reruns each block's forward in backward, attention included; at long
context attention is most of a block's FLOPs, so that recompute costs about a quarter of the step.
Keeping each layer's attention output and LSE from the first forward (what every attention op
saves for its own backward) lets the recompute skip the attention: it only forms the layer's output
``out @ wo.T`` again, one matmul. ``"device"`` keeps them on the device (per layer N*H*d*b plus
the LSEs, N local tokens, from the layer's forward to its backward); ``"host"`` parks them in host
memory through the shared ``runtime.host_store`` and fetches each back during the recompute, the
next layer's (backward runs layers in reverse) prefetched while the current one runs.

A first forward is told from a recompute by whether autograd's engine is running a backward
(``torch._C._current_graph_task_id``, the test ``torch.utils.checkpoint`` itself makes): a forward
outside backward keeps (replacing what an earlier forward of the layer kept but never used), a
recompute takes the layer's entry and drops it after the layer's last recompute (a block inside a
checkpoint group runs twice in backward, in the group's recompute and in its own:
``expect_recomputes``). Forwards without grad (evaluation) keep nothing:
the style names no store for them (``parallel.style``; under ``torch.compile`` grad mode is
guarded, so this holds in compiled blocks too). Results are exact: the kept tensors are what the
recompute would compute again from the same input.

Why not torch's selective checkpointing (``create_selective_checkpoint_contexts`` with the
attention op as MUST_SAVE): its policy sees dispatched ops, while the memory planner runs the op's
body transparently (``kernels.op_mode``) and would trace the recompute it skips; and it keeps on
the device only.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from upipe_dtensor.runtime.host_store import HostMemory
from upipe_dtensor.runtime.torch_private import current_graph_task_id

KeepAttention = Literal["none", "host", "device"]

_NAMED: weakref.WeakValueDictionary[str, KeptAttention] = weakref.WeakValueDictionary()


def in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread (a checkpoint's recompute)."""
    return current_graph_task_id() != -1


class KeptAttention:
    """Each layer's (out, lse) from its forward until its recompute, on the device or the host."""

    _names = itertools.count()

    def __init__(self, where: KeepAttention, host_device: torch.device = torch.device("cpu")):
        if where not in ("host", "device"):
            raise ValueError(f"keep_attention must be 'host' or 'device' to keep, got {where!r}")
        self.host = HostMemory(host_device) if where == "host" else None
        self.name = f"kept-attention-{next(KeptAttention._names)}"
        self._entries: dict[int, list] = {}  # layer -> [(out, lse) or their Parked, uses left]
        self._recomputes: list[tuple[weakref.ref, int]] = []
        _NAMED[self.name] = self

    def expect_recomputes(self, attention: torch.nn.Module, count: int) -> None:
        """``attention``'s forward runs ``count`` times in backward: a block inside a checkpoint
        group (``memory.offload.CheckpointGroup``) runs in the group's recompute and again in
        its own checkpoint's. Its kept attention serves each of them and is dropped after the
        last; taken at the first, the block's own recompute would find nothing and recompute
        the attention (the default is once)."""
        self._recomputes.append((weakref.ref(attention), count))

    def _uses(self, layer: int) -> int:
        """How many recomputes the layer whose ``wo`` weight is ``layer`` serves: looked up
        when it keeps, through the module's current ``wo`` (the unsharded parameter FSDP2 puts
        there while the block runs)."""
        for module, count in self._recomputes:
            attention = module()
            if attention is not None and id(attention.wo.weight) == layer:
                return count
        return 1

    def keep(self, layer: int, out: Tensor, lse: Tensor) -> None:
        self._entries.pop(layer, None)  # an earlier forward's, never recomputed: re-inserted last
        if self.host is None:
            kept = (out, lse)
        else:
            store = self.host.store(out.device)
            kept = (store.park(out), store.park(lse))
        self._entries[layer] = [kept, self._uses(layer)]

    def take(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """The kept (out, lse) for one of the layer's recomputes; dropped after the last."""
        entry = self._entries.get(layer)
        if entry is None:
            return None
        kept, uses_left = entry
        last = uses_left == 1
        if last:
            del self._entries[layer]
        else:
            entry[1] = uses_left - 1
        if self.host is None:
            return kept
        store = self.host.store(kept[0].device)
        if self._entries:  # the layer recomputed next (the latest kept) starts coming back now
            for parked in next(reversed(self._entries.values()))[0]:
                store.prefetch(parked)
        return tuple(store.retrieve(parked, release=last) for parked in kept)

    def forward(
        self,
        wo: Tensor,
        run: Callable[[], tuple[Tensor, Tensor, Tensor]],
        output: Callable[[Tensor], Tensor],
    ) -> tuple[Tensor, Tensor, Tensor]:
        """An attention op's (y, out, lse): kept ones in a recompute, else ``run()``, kept.
        ``output(out)`` is the pre-``wo`` sequence-layout output of the op's saved ``out``
        (which an op may keep in another layout), for y = output(out) @ wo.T.

        The layer is told by its ``wo`` weight, the same tensor object in the forward and in its
        recompute (FSDP2 regathers into the same unsharded parameter), not by a name in the op's
        arguments: those are constants of a compiled graph, and one per layer would compile every
        block again."""
        layer = id(wo)
        if in_backward():
            kept = self.take(layer)
            if kept is not None:
                out, lse = kept
                return output(out) @ wo.t(), out, lse
            return run()
        y, out, lse = run()
        self.keep(layer, out, lse)
        return y, out, lse


def kept_forward(
    keep: str,
    wo: Tensor,
    run: Callable[[], tuple[Tensor, Tensor, Tensor]],
    output: Callable[[Tensor], Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """``KeptAttention.forward`` of the store named by ``keep`` (``KeptAttention.name``; an op
    without kept attention does not call this)."""
    kept = _NAMED.get(keep)
    if kept is None:
        raise ValueError(f"no kept attention named {keep!r}: the style that owned it is gone")
    return kept.forward(wo, run, output)
