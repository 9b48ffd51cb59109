"""The elementwise chains inside the tiled ops, compiled into fused kernels with the blocks.

A compiled block calls each tiled op (RMSNorm, the SwiGLU MLP, the attention op with its RoPE) as
one opaque node, so inductor cannot fuse what runs inside it: per tile, RMSNorm's float32 upcast,
square, mean, scale and cast, SwiGLU's silu and product and their gradients, RoPE's rotation, each
a memory-bound kernel reading and writing the tile. At 128K tokens on 8 GPUs these are most of the
step's memory-bound time. With ``[compile] fuse_tiles`` (``parallelize_llama`` calls
``use_backend``) the functions marked ``@fused`` are compiled themselves, fullgraph with static
shapes (one graph for the full tiles and one for the last, shorter one), and the ops call them at
run time; otherwise they run eagerly, the same arithmetic in the same order. The planner compiles
them with its own backend (``planning.compiled``), so a plan counts their fused kernels.

They write their results into buffers they are given (a tile of the op's output, or an input
that dies there) rather than returning new tensors: eagerly they hold no more tile-sized
temporaries than the loops they came from, and compiled, inductor writes straight into them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from upipe_dtensor.kernels.op_mode import compile_is_tracing
from upipe_dtensor.modes.rehearsal import around_compiled_calls

_backend: str | None = None


def use_backend(backend: str | None) -> None:
    """Compile ``@fused`` functions with this dynamo backend from now on (None: run eagerly).
    Process-wide: the job that builds a model sets it (``parallelize_llama``)."""
    global _backend
    _backend = backend


@contextlib.contextmanager
def restored_backend() -> Iterator[None]:
    """Whatever runs inside may set another backend; the one before comes back afterwards (the
    planner builds a model of another job in the same process)."""
    previous = _backend
    try:
        yield
    finally:
        use_backend(previous)


def fused(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, compiled with the backend of ``use_backend`` (once per backend) when one is set."""
    compiled: dict[str, Callable[..., Any]] = {}

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        if _backend is None or compile_is_tracing():  # traced: fused by the outer compile
            return fn(*args)
        if _backend not in compiled:
            compiled[_backend] = torch.compile(fn, backend=_backend, fullgraph=True, dynamic=False)
        with around_compiled_calls()():  # the planner's rehearsal: its mode off (modes)
            return compiled[_backend](*args)

    return run
