"""Activation checkpointing per TransformerBlock, with the saved block inputs moved to host memory.

Full checkpointing keeps only each block's input for backward; at millions of tokens even those
(one (S/C, D) tensor per block, 5 GiB each for Llama3-8B at 5M tokens on 8 GPUs) add up to more
than a GPU holds, so they go to host memory. With non-reentrant checkpointing the block's inputs
are the only tensors the outer autograd graph saves, so a ``saved_tensors_hooks`` pair around the
checkpoint call sees exactly them; constants (the RoPE table, positions) are not part of the
autograd graph and stay where they are.

On CUDA the device-to-host copy runs on a side stream into pinned host buffers (reused from step
to step), and during backward the input of the *next* block to be recomputed is copied back on
another side stream while the current block computes, so the copies hide behind compute. On CPU
the same code path runs with plain copies and no streams (numerically identical, no memory saved).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint


@dataclass
class _Offloaded:
    """One saved tensor living in host memory, and its way back."""

    host: torch.Tensor
    device: torch.device
    copied_to_host: torch.cuda.Event | None
    index: int
    on_device: torch.Tensor | None = None
    copied_to_device: torch.cuda.Event | None = None


@dataclass
class HostOffload:
    """Saved-tensor hooks that park activations in host memory and prefetch them back.

    ``host_bytes`` / ``peak_host_bytes`` report the host memory held (pinned buffers included).
    """

    device: torch.device
    host_device: torch.device = torch.device("cpu")
    """Where parked tensors live; the memory planner passes a stand-in it counts as host."""
    host_bytes: int = 0
    peak_host_bytes: int = 0
    _in_flight: list[_Offloaded] = field(default_factory=list)
    _pool: dict[tuple, list[torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        cuda = self.device.type == "cuda"
        self._to_host = torch.cuda.Stream(self.device) if cuda else None
        self._to_device = torch.cuda.Stream(self.device) if cuda else None

    def _host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        key = (tuple(like.shape), like.dtype)
        free = self._pool.get(key)
        if free:
            return free.pop()
        pinned = self.device.type == "cuda"
        buffer = torch.empty(like.shape, dtype=like.dtype, device=self.host_device, pin_memory=pinned)
        self.host_bytes += buffer.nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        return buffer

    def pack(self, tensor: torch.Tensor):
        if tensor.device != self.device or not (tensor.requires_grad or tensor.grad_fn is not None):
            return tensor  # a constant (RoPE table, positions) or already on the host
        host = self._host_buffer(tensor)
        event = None
        if self._to_host is not None:
            self._to_host.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._to_host):
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(self._to_host)  # keep its memory until the copy is done
                event = torch.cuda.Event()
                event.record()
        else:
            host.copy_(tensor)
        handle = _Offloaded(host, tensor.device, event, index=len(self._in_flight))
        self._in_flight.append(handle)
        return handle

    def _fetch(self, handle: _Offloaded) -> None:
        """Start (CUDA: asynchronously) the copy of ``handle`` back to the device."""
        if handle.on_device is not None:
            return
        if self._to_device is None:  # a real copy even on CPU: the host buffer is reused
            handle.on_device = handle.host.to(handle.device, copy=True)
            return
        with torch.cuda.stream(self._to_device):
            self._to_device.wait_event(handle.copied_to_host)
            handle.on_device = handle.host.to(handle.device, non_blocking=True)
            handle.copied_to_device = torch.cuda.Event()
            handle.copied_to_device.record()

    def unpack(self, handle) -> torch.Tensor:
        if not isinstance(handle, _Offloaded):
            return handle
        self._fetch(handle)
        if handle.index > 0:  # backward runs blocks in reverse: the previous one is next
            self._fetch(self._in_flight[handle.index - 1])
        tensor, handle.on_device = handle.on_device, None  # autograd owns it from here on
        if handle.copied_to_device is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(handle.copied_to_device)
            tensor.record_stream(current)
            # The host buffer may be reused once the copy has finished.
            handle.copied_to_device.synchronize()
        self._pool.setdefault((tuple(handle.host.shape), handle.host.dtype), []).append(handle.host)
        if handle.index == 0:
            self._in_flight.clear()  # the step's last unpack: the next forward starts afresh
        return tensor

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _checkpoint_fn(module: nn.Module, *args, offload: HostOffload | None = None, **kwargs):
    with offload.hooks() if offload is not None else contextlib.nullcontext():
        return checkpoint(module, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def apply_activation_checkpointing(
    model: nn.Module, *, offload: HostOffload | None, offload_skip_last: int
) -> None:
    """Wrap every block in full activation checkpointing; offload the inputs of all blocks but
    the last ``offload_skip_last`` (backward needs those first, so parking them buys nothing).

    torch's ``checkpoint_wrapper`` keeps parameter names unchanged in state dicts, so snapshots
    load with or without checkpointing.
    """
    names = list(model.layers.keys())
    for position, name in enumerate(names):
        use_offload = offload if position < len(names) - offload_skip_last else None
        model.layers[name] = checkpoint_wrapper(
            model.layers[name], checkpoint_fn=functools.partial(_checkpoint_fn, offload=use_offload)
        )
