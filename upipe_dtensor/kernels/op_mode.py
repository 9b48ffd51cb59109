"""Run the project's custom ops opaquely (training, compile) or transparently (memory tracking).

The memory-bounded loops (UPipe stages, MLP tiles, loss chunks) are ``torch.library`` custom ops so
that ``torch.compile`` cannot reorder them; the price is that a ``TorchDispatchMode`` sees only an
op's outputs, not the per-stage buffers inside it. Inside ``transparent_ops()`` the same Python
bodies run through a plain autograd Function instead, so every allocation they make reaches the
dispatch modes (the memory planner's tracker, FakeTensorMode). Numbers are identical either way.
The mode is the planner's, in ``modes.ops``; ``call`` asks it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from upipe_dtensor.modes.ops import ops_transparent
from upipe_dtensor.runtime.torch_private import OpOverload, is_fx_symbolic_tracing


@dataclass(frozen=True)
class OpSpec:
    """A custom op, the Python body it runs, and (for forward ops) its autograd pieces. Every
    spec is registered (``project_ops``): compiled graphs call the ops by name."""

    op: Callable[..., Any]
    body: Callable[..., Any]
    setup_context: Callable[..., None] | None = None
    backward: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        _SPECS[self.op._opoverload] = self


_SPECS: dict[OpOverload, OpSpec] = {}


def project_ops() -> dict[OpOverload, OpSpec]:
    """Every registered op (``torch.ops.upipe.*``), by the overload a compiled graph calls."""
    return dict(_SPECS)


class _Transparent(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: OpSpec, *inputs):
        output = spec.body(*inputs)
        spec.setup_context(ctx, inputs, output)
        ctx.spec = spec
        return output

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.spec.backward(ctx, *grads))


def compile_is_tracing() -> bool:
    """Whether ``torch.compile`` is tracing the caller (dynamo, or AOT autograd tracing a compiled
    graph's forward and backward). torch 2.13 marks the whole compile session as compiling;
    torch 2.11 does not while AOT autograd traces, where only FX's tracing flag is up (a nested
    ``torch.compile`` there raises "Detected that you are using FX to symbolically trace a
    dynamo-optimized function"). ``is_compiling`` first: under dynamo nothing else is read."""
    return torch.compiler.is_compiling() or is_fx_symbolic_tracing()


def call(spec: OpSpec, *args):
    """``spec.op(*args)``, or its body when ops are transparent (with the op's own autograd).
    While ``torch.compile`` traces, always the op: a compiled graph calls it, and a planned
    compiled graph runs its body (``planning.compiled``)."""
    if compile_is_tracing() or not ops_transparent():  # compiling first: no guard on it
        return spec.op(*args)
    if spec.backward is None:  # a backward op: already running inside autograd's backward
        return spec.body(*args)
    return _Transparent.apply(spec, *args)
