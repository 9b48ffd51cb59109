"""Compiled blocks that hold the same tensors on torch 2.11 as on 2.13: the block compiled as two
regions where torch's compiled backward cannot free the gradient it is handed.

A compiled block's backward is one autograd node (AOTAutograd's ``CompiledFunction``). Its first
input is the gradient of the block's output, one (N, D) tensor (5 GiB at 5M tokens per GPU for
Llama3-8B), whose last use is early: the MLP's backward and the residual sum. On torch 2.13 the
engine hands a compiled backward its gradients in a list the graph empties
(``torch.autograd.Function.boxed_grads_call``), so that gradient is freed there, before the
attention's backward and its buffers, the block's peak. Torch 2.11 has no such call: the engine
holds a node's gradients until the node returns, so the whole-block graph keeps the output
gradient through the attention's backward, one more (N, D) tensor at the peak of every block's
backward (the planner measured 59.14 against 53.89 GiB for ``recipes/llama3_8b_5M.toml``, and
84.15 against 75.75 GiB for the 8M recipe). Forward graphs, saved tensors and partitions are the
same on both; only the gradient's lifetime differs.

Where the engine cannot take gradients boxed, each block is therefore compiled as two regions,
two autograd nodes: the attention half ``h = x + attention(attention_norm(x))`` and the MLP half
``h + mlp(ffn_norm(h))``. The MLP half's backward returns the gradient of ``h`` and the engine
frees the block's output gradient then, where 2.13's graph frees it; the attention half's
backward holds the gradient of ``h``, which 2.13's graph also keeps to its end (the residual sum).
With the recipes' memory stack (tiled norms and MLP: opaque ops the partitioner saves around and
never recomputes) each region saves what the whole-block graph saved of it, so both torches keep
the same tensors (the 8B, 32B and Qwen3 recipes plan the same on both). Where the engine takes
gradients boxed, the block compiles whole, as before.

Every family's block has this shape (torchtitan 0.2.2's and 0.3.0's Llama3 and Qwen3 blocks: the
attention called with the block's arguments after ``x``; Qwen3's MLP the MoE where enabled), and
the region forward is a subclass of the block's own class swapped in (as ``memory.tiled_mlp``
does): parameter names do not change, and the regions are module-level functions that take the
block as an argument, so dynamo compiles each once for every block (guarded by the shared type),
not once per block past its recompile limit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from upipe_dtensor.memory.tiled_moe import is_tiled_moe, moe_modules
from upipe_dtensor.modes.rehearsal import around_compiled_calls


def engine_holds_gradients() -> bool:
    """Whether this torch's engine holds a compiled backward's incoming gradients until the
    backward returns (torch 2.11; 2.13 hands them boxed, ``boxed_grads_call``)."""
    return not hasattr(torch.autograd.Function, "boxed_grads_call")


def _mlp(block: nn.Module) -> nn.Module:
    """The block's MLP: Qwen3's MoE where enabled, else its feed-forward."""
    return block.moe if getattr(block, "moe_enabled", False) else block.feed_forward


def attention_half(block: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``x + attention(attention_norm(x), ...)``: the block's first residual sum."""
    return x + block.attention(block.attention_norm(x), *args, **kwargs)


def mlp_half(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``h + mlp(ffn_norm(h))``: the block's output."""
    return h + _mlp(block)(block.ffn_norm(h))


class _RegionForward:
    """The block's forward as its two compiled regions (the class's ``_regions``), each run in
    the context compiled calls run in (the planner's rehearsal takes its torch-function mode
    off there, as for a whole compiled block: ``modes.rehearsal``)."""

    _regions: tuple = ()

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        attention, mlp = self._regions
        with around_compiled_calls()():
            h = attention(self, x, *args, **kwargs)
        with around_compiled_calls()():
            return mlp(self, h)


_CLASSES: dict[tuple[type[nn.Module], str, bool], type[nn.Module]] = {}


def region_class(cls: type[nn.Module], backend: str, eager_mlp: bool = False) -> type[nn.Module]:
    """One subclass of ``cls`` per backend whose forward runs the two regions, both compiled
    or (``eager_mlp``) the attention half only."""
    if issubclass(cls, _RegionForward):
        cls = cls.__mro__[2]
    key = (cls, backend, eager_mlp)
    if key not in _CLASSES:
        compiled = (attention_half,) if eager_mlp else (attention_half, mlp_half)
        regions = tuple(
            torch.compile(fn, fullgraph=True, dynamic=False, backend=backend) for fn in compiled
        )
        regions += (mlp_half,) * eager_mlp
        _CLASSES[key] = type(f"Regions{cls.__name__}", (_RegionForward, cls), {"_regions": regions})
    return _CLASSES[key]


def compile_block(
    block: nn.Module, backend: str, regions: bool | None = None, eager_mlp: bool = False
) -> None:
    """Compile ``block`` in place: whole (``nn.Module.compile``), or as two regions where the
    engine holds a compiled backward's gradients (``regions`` None: this torch decides).

    A block whose mixture of experts is tiled (``memory.tiled_moe``) or exchanges its tokens
    between ranks (``eager_mlp``: expert parallelism, whose all-to-all sizes come from the host)
    compiles its attention half only: each MoE tile is an activation-checkpointed region, which
    the planner cannot replay inside a compiled graph, and a host-sized exchange would break a
    fullgraph compile; the MoE's matmuls are grouped GEMMs and opaque ops, which a compile would
    not fuse anyway."""
    eager_mlp = eager_mlp or any(is_tiled_moe(module) for module in moe_modules(block))
    if regions is None:
        regions = engine_holds_gradients() or eager_mlp
    if regions:
        block.__class__ = region_class(type(block), backend, eager_mlp)
    else:
        block.compile(fullgraph=True, dynamic=False, backend=backend)
