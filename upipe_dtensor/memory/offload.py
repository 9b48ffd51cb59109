"""Activation checkpointing per TransformerBlock, with the saved block inputs moved to host memory.

Full checkpointing keeps only each block's input for backward; at millions of tokens even those
(one (S/C, D) tensor per block, 5 GiB each for Llama3-8B at 5M tokens on 8 GPUs) add up to more
than a GPU holds, so they go to host memory. With non-reentrant checkpointing the block's inputs
are the only tensors the outer autograd graph saves, so a ``saved_tensors_hooks`` pair around the
checkpoint call sees exactly them; constants (the RoPE table, positions) are not part of the
autograd graph and stay where they are.

On CUDA the device-to-host copy runs on a side stream into pinned host buffers (reused from step
to step), and during backward the input of the *next* block to be recomputed is copied back on
another side stream while the current block computes, so the copies hide behind compute
(``prefetch``; at millions of tokens the copy is negligible next to a block's compute and the
prefetched input would raise the peak by one block input, so long recipes turn it off). On CPU
the same code path runs with plain copies and no streams (numerically identical, no memory saved).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from upipe_dtensor.runtime.host_store import HostStore, Parked
from upipe_dtensor.runtime.torch_private import checkpoint_wrapper


@dataclass
class _Offloaded:
    """One saved block input in host memory, and its place in the step's order."""

    parked: Parked
    index: int
    dtensor: tuple | None = None
    """A DTensor's (mesh, placements, shape, stride) (the residual stream under tensor
    parallelism): its local tensor is parked, the DTensor rebuilt around it when fetched."""


class HostOffload:
    """Saved-tensor hooks that park activations in host memory and prefetch them back.

    ``host_bytes`` / ``peak_host_bytes`` report the host memory held (pinned buffers included).
    ``host_device`` is where parked tensors live; the memory planner passes a stand-in it counts
    as host.
    """

    def __init__(
        self,
        device: torch.device,
        host_device: torch.device = torch.device("cpu"),
        *,
        prefetch: bool = True,
    ) -> None:
        self.store = HostStore(device, host_device)
        self.prefetch = prefetch
        """Start copying the next block's input back as soon as the current one is fetched."""
        self._in_flight: list[_Offloaded] = []

    @property
    def host_bytes(self) -> int:
        return self.store.host_bytes

    @property
    def peak_host_bytes(self) -> int:
        return self.store.peak_host_bytes

    def pack(self, tensor: torch.Tensor):
        if (
            tensor.device != self.store.device
            or not (tensor.requires_grad or tensor.grad_fn is not None)
            or tensor.numel() == 0
        ):
            # A constant (RoPE table, positions), already on the host, or empty: torch 2.11's
            # checkpoint saves a (0,) placeholder beside each block's inputs, which holds nothing
            # and is unpacked out of the blocks' order.
            return tensor
        layout = None
        if isinstance(tensor, DTensor):
            layout = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
            with torch.no_grad():
                tensor = tensor.to_local()
        handle = _Offloaded(self.store.park(tensor), index=len(self._in_flight), dtensor=layout)
        self._in_flight.append(handle)
        return handle

    def unpack(self, handle) -> torch.Tensor:
        if not isinstance(handle, _Offloaded):
            return handle
        self.store.prefetch(handle.parked)  # queued first: it is needed now
        if (
            self.prefetch and handle.index > 0
        ):  # backward runs blocks in reverse: the previous one is next
            self.store.prefetch(self._in_flight[handle.index - 1].parked)
        tensor = self.store.retrieve(handle.parked, release=True)
        if handle.index == 0:
            self._in_flight.clear()  # the step's last unpack: the next forward starts afresh
        if handle.dtensor is not None:
            mesh, placements, shape, stride = handle.dtensor
            tensor = DTensor.from_local(
                tensor, mesh, placements, run_check=False, shape=shape, stride=stride
            )
        return tensor

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _checkpoint_fn(module: nn.Module, *args, offload: HostOffload | None = None, **kwargs):
    with offload.hooks() if offload is not None else contextlib.nullcontext():
        return checkpoint(module, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


class CheckpointGroup:
    """Consecutive blocks checkpointed as one: only the group's input is kept (in host memory
    with ``offload``). Recomputing the group in backward runs each block but the last through its
    own checkpoint, so it keeps just those blocks' inputs (one more (S/C, D) tensor each on the
    device), and the last block computes its activations for its backward right away."""

    def __init__(self, names: list[str], offload: HostOffload | None) -> None:
        self.names, self.offload = names, offload

    def __call__(self, layers: nn.ModuleDict, h: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        def run(x: torch.Tensor) -> torch.Tensor:
            for name in self.names:
                x = layers[name](x, *args, **kwargs)
            return x

        with self.offload.hooks() if self.offload is not None else contextlib.nullcontext():
            return checkpoint(run, h, use_reentrant=False, preserve_rng_state=False)


def offloads_group(first: int, size: int, n_blocks: int, offload_skip_last: int) -> bool:
    """Whether the checkpoint of blocks ``first`` to ``first + size - 1`` (of ``n_blocks``)
    parks its input in host memory: unless it holds one of the last ``offload_skip_last``
    blocks, whose inputs backward needs first."""
    return first + size <= n_blocks - offload_skip_last


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    offload: HostOffload | None,
    offload_skip_last: int,
    blocks_per_checkpoint: int = 1,
) -> tuple[CheckpointGroup, ...]:
    """Full activation checkpointing; offload the saved inputs of all blocks but the last
    ``offload_skip_last`` (backward needs those first, so parking them buys nothing).

    With ``blocks_per_checkpoint`` k = 1 every block is wrapped in its own checkpoint. With k > 1
    the blocks are checkpointed in groups of k (``CheckpointGroup``s, returned for the forward
    plan, ``models.long_context.ForwardPlan``, to run in order):
    host memory for saved inputs drops k-fold, for one more forward of k - 1 blocks per group
    in backward and k - 1 more block inputs on the device while a group recomputes. A group is
    offloaded unless it holds one of the last ``offload_skip_last`` blocks.

    torch's ``checkpoint_wrapper`` keeps parameter names unchanged in state dicts, so snapshots
    load with or without checkpointing.
    """
    names = list(model.layers.keys())
    if blocks_per_checkpoint == 1:
        for position, name in enumerate(names):
            parks = offloads_group(position, 1, len(names), offload_skip_last)
            use_offload = offload if parks else None
            model.layers[name] = checkpoint_wrapper(
                model.layers[name],
                checkpoint_fn=functools.partial(_checkpoint_fn, offload=use_offload),
            )
        return ()
    groups = []
    for first in range(0, len(names), blocks_per_checkpoint):
        group = names[first : first + blocks_per_checkpoint]
        for name in group[:-1]:  # recomputed again inside the group's recompute
            model.layers[name] = checkpoint_wrapper(
                model.layers[name], checkpoint_fn=_checkpoint_fn
            )
        parks = offloads_group(first, len(group), len(names), offload_skip_last)
        groups.append(CheckpointGroup(group, offload if parks else None))
    return tuple(groups)
