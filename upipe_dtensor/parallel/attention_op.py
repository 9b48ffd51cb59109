"""Register an attention op (staged UPipe/Ulysses/ring, FPDT) as one opaque custom-op pair.

``torch.compile(fullgraph=True)`` then sees a single node per layer, which it cannot split into
whole-sequence tensors, and the fake implementations give it the output shapes. Every attention
op has the same tensors in and out and the same plain values (``AttentionParams``, one frozen
record), so the schema is built here once, from the record's fields:

    forward (x, wq, wk, wv, wo, q_norm?, k_norm?, rope, doc_ids?, *params) -> (y, out, lse)
    backward(grad_y, x, <weights>, rope, doc_ids?, out, lse, *params)
             -> (grad_x, grad_wq, grad_wk, grad_wv, grad_wo, grad_q_norm, grad_k_norm)

The op bodies receive the weights and the values as records:
``forward(x, weights, rope, doc_ids, params)`` and
``backward(grad_y, x, weights, rope, doc_ids, out, lse, params) -> (grad_x, grads)``, where
``weights`` is an ``AttentionWeights`` (the projections, and the per-head norms of families with
QK-norm, e.g. Qwen3) and ``grads`` the same record of their gradients. Adding a weight is one
field of that record. ``y = out @ wo.T`` is the layer's output; ``out`` (the pre-``wo`` attention
output) and ``lse`` (one log-sum-exp per head and token, float32) are saved for backward. Taking
``wo`` inside lets backward form each stage's slice of the pre-``wo`` gradient from ``grad_y``
directly, so the whole (tokens, H*d) gradient is never materialised.

When backward receives the ``out`` of a forward that ran inside autograd's backward (an activation
checkpoint's recompute), that tensor serves this backward only: torch's non-reentrant checkpoint
recomputes for every backward and refuses to unpack a saved tensor twice, even under
``GraphExecGroup``. The op then tells its backward that ``out`` is scratch
(``AttentionParams.output_is_scratch``): a buffer of the output's size to hold the query gradients
in, instead of a new one. The output of a forward outside backward (no checkpoint; or compiled,
where the recompute is traced) stays intact for any number of backwards (``retain_graph``). The
backward op's schema declares no mutation: it only writes a tensor nothing reads afterwards, and a
declared one would bump the version counter of the forward's own output on every call, which
breaks ``retain_graph``.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from upipe_dtensor.kernels.merge import accumulation_dtype
from upipe_dtensor.kernels.op_mode import OpSpec, call
from upipe_dtensor.memory.kept_attention import in_backward, kept_forward
from upipe_dtensor.modes.ops import computation_runner


class AttentionWeights(NamedTuple):
    """One attention layer's weights as the op takes them: the bias-free projections (rows are
    heads of ``head_dim``), and the per-head norms of Q and K before RoPE (Qwen3's QK-norm;
    None for families without, e.g. Llama3)."""

    wq: Tensor
    wk: Tensor
    wv: Tensor
    wo: Tensor
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None


GRADIENTS = ("x", *AttentionWeights._fields)
"""The op's differentiable inputs, in schema order: bit i of ``AttentionParams.grads`` is the
i-th."""
ALL_GRADIENTS = (1 << len(GRADIENTS)) - 1

_OPTIONAL_WEIGHTS = ("q_norm", "k_norm")
_WEIGHTS = ", ".join(
    f"Tensor{'?' if name in _OPTIONAL_WEIGHTS else ''} {name}" for name in AttentionWeights._fields
)
_TENSORS = f"Tensor x, {_WEIGHTS}, Tensor rope, Tensor? doc_ids"
_N_TENSORS = 3 + len(AttentionWeights._fields)
"""x, the weights, rope and doc_ids: the op's tensor arguments, in the schema's order."""
_GRADS = ", ".join("Tensor" for _ in range(1 + len(AttentionWeights._fields)))


@dataclass(frozen=True, kw_only=True)
class AttentionParams:
    """The plain values of one attention layer's call: the mesh axes, the head stages, the
    sequence chunks and the kernel. One record for every op, so they share one schema."""

    head_group: str
    """Process group of the head (all-to-all) axis; "" when it has one rank."""
    head_degree: int
    """C_h, the ranks that exchange heads (1 for ring attention)."""
    ring_group: str = ""
    """Process group of the ring (p2p) axis; "" without one."""
    ring_degree: int = 1
    """R, the ranks K/V travel around (1: no ring)."""
    head_dim: int
    heads_per_stage: int
    """U, query heads per stage across the head axis."""
    chunks: int = 1
    """FPDT's sequence chunks (1: the whole sequence in each stage)."""
    scale: float
    """Softmax scale (head_dim ** -0.5 for Llama3 and Qwen3)."""
    rope_pairs: str = "interleaved"
    """Which elements of a head RoPE rotates together (``kernels.rope.RopePairs``): Llama3's
    interleaved pairs or Qwen3's halves."""
    qk_transform: str = ""
    """The per-head function of Q and K before RoPE (``parallel.qk_transform``; "" for none,
    "rms_norm" for Qwen3's QK-norm)."""
    qk_eps: float = 0.0
    """The epsilon of ``qk_transform``."""
    backend: str
    """Local attention backend (``kernels.backends.BACKENDS``)."""
    kernel_device: str = ""
    """The device type the kernels are chosen for; "" means the tensors' own. The planner says
    "cuda" to trace the CUDA kernels on fake CPU tensors (``kernels.attention.op_kernel``)."""
    overlap_stages: bool = False
    """Start stage s+1's all-to-alls before stage s's attention and wait for each just before its
    use (``staged_attention``); False waits for every exchange as it is made."""
    keep: str = ""
    """Attention kept for the recompute (``memory.kept_attention``): the store's name, or "" for
    none."""
    store_name: str = ""
    """FPDT: the host store that parks earlier chunks (``runtime.host_store.named_host_store``)."""
    output_is_scratch: bool = False
    """Set by the op for its backward, never by a style: the saved output may be overwritten (it
    comes from a checkpoint's recompute; see the module docstring)."""
    grads: int = ALL_GRADIENTS
    """Set by the op for its backward, never by a style: the gradients autograd asks for
    (``ctx.needs_input_grad``), bit i for the i-th of ``GRADIENTS``. Frozen weights (LoRA, frozen
    layers) cost no weight-gradient memory or FLOPs: the backward forms only these."""

    @property
    def query_heads_per_rank(self) -> int:
        return self.heads_per_stage // self.head_degree

    def needs(self, name: str) -> bool:
        """Whether backward forms the gradient of ``name`` (one of ``GRADIENTS``)."""
        return bool(self.grads >> GRADIENTS.index(name) & 1)


_SCHEMA_TYPES = {str: "str", int: "int", float: "float", bool: "bool"}
_PARAM_FIELDS = dataclasses.fields(AttentionParams)
_PARAMS_SCHEMA = ", ".join(
    f"{_SCHEMA_TYPES[typing.get_type_hints(AttentionParams)[f.name]]} {f.name}"
    for f in _PARAM_FIELDS
)


def _params(values: tuple) -> AttentionParams:
    return AttentionParams(**{f.name: value for f, value in zip(_PARAM_FIELDS, values)})


def _flat(params: AttentionParams) -> tuple:
    return tuple(getattr(params, f.name) for f in _PARAM_FIELDS)


def _computed(
    name: str, args: tuple, compute: Callable[..., tuple[Tensor, ...]], *inputs: object
) -> tuple[Tensor, ...]:
    """``compute(*inputs)``, or what the planner's runner makes of it (``modes.ops``)."""
    runner = computation_runner()
    if runner is None:
        return compute(*inputs)
    return runner(name, args, functools.partial(compute, *inputs))


class AttentionOp:
    """A registered fused attention op (projections, attention and ``wo``): ``op(x, weights,
    rope, doc_ids, params) -> y``."""

    def __init__(
        self,
        name: str,
        forward: Callable,
        backward: Callable,
        output: Callable[[Tensor, AttentionWeights, AttentionParams], Tensor] | None = None,
    ) -> None:
        """``forward(x, weights, rope, doc_ids, params) -> (y, out, lse)`` and
        ``backward(grad_y, x, weights, rope, doc_ids, out, lse, params) -> (grad_x, grads)``,
        with ``weights`` and ``grads`` ``AttentionWeights`` (None for a gradient autograd does
        not ask for: ``AttentionParams.needs``). ``output(out, weights, params)`` is the
        pre-``wo`` output in the sequence layout from the saved ``out``, when the op saves it in
        another layout (None: ``out`` is it), for kept attention's recompute."""

        def forward_body(*args):
            x, weights, rope, doc_ids = _inputs(args[:_N_TENSORS])
            params = _params(args[_N_TENSORS:])
            inputs = (x, weights, rope, doc_ids, params)
            if not params.keep:
                return _computed(f"{name} forward", args, forward, *inputs)
            return kept_forward(
                params.keep,
                weights.wo,
                functools.partial(_computed, f"{name} forward", args, forward, *inputs),
                (lambda out: out) if output is None else lambda out: output(out, weights, params),
            )

        def backward_computation(grad_y, *args):
            x, weights, rope, doc_ids = _inputs(args[:_N_TENSORS])
            out, lse = args[_N_TENSORS : _N_TENSORS + 2]
            params = _params(args[_N_TENSORS + 2 :])
            grad_x, grads = backward(grad_y, x, weights, rope, doc_ids, out, lse, params)
            return tuple(x.new_empty(0) if g is None else g for g in (grad_x, *grads))

        def backward_body(grad_y, *args):
            args = (grad_y, *args)
            return _computed(f"{name} backward", args, backward_computation, *args)

        forward_op = torch.library.custom_op(
            f"upipe::{name}_fwd",
            forward_body,
            mutates_args=(),
            schema=f"({_TENSORS}, {_PARAMS_SCHEMA}) -> (Tensor, Tensor, Tensor)",
        )
        backward_op = torch.library.custom_op(
            f"upipe::{name}_bwd",
            backward_body,
            mutates_args=(),
            schema=f"(Tensor grad_y, {_TENSORS}, Tensor out, Tensor lse, {_PARAMS_SCHEMA}) "
            f"-> ({_GRADS})",
        )
        forward_op.register_fake(_fake_forward)
        backward_op.register_fake(_fake_backward)
        forward_op.register_autograd(self._backward, setup_context=_setup_context)
        self.forward = OpSpec(forward_op, forward_body, _setup_context, self._backward)
        self.backward = OpSpec(backward_op, backward_body)

    def _backward(self, ctx, grad_y: Tensor, _grad_out: Tensor | None, _grad_lse: Tensor | None):
        *tensors, out, lse = ctx.saved_tensors
        needed = ctx.needs_grads
        params = dataclasses.replace(
            _params(ctx.constants),
            output_is_scratch=_recomputed(out),
            grads=sum(1 << i for i, needs in enumerate(needed) if needs),
        )
        grads = call(self.backward, grad_y, *tensors, out, lse, *_flat(params))
        grads = [g if needs else None for g, needs in zip(grads, needed)]
        return (*grads, None, None) + (None,) * len(_PARAM_FIELDS)

    def __call__(
        self,
        x: Tensor,
        weights: AttentionWeights,
        rope: Tensor,
        doc_ids: Tensor | None,
        params: AttentionParams,
    ) -> Tensor:
        y, _, _ = call(self.forward, x, *weights, rope, doc_ids, *_flat(params))
        return y


class QKVAttentionOp:
    """A registered attention op on given queries, keys and values (the styles' op-level entry,
    ``ContextParallelAttention.attention``): ``op(q, k, v, doc_ids, params) -> (out, lse)``,
    differentiable in q, k and v. ``lse`` carries no gradient (as the LSE that torch's flash
    kernels return)."""

    def __init__(self, name: str, forward: Callable, backward: Callable) -> None:
        """``forward(q, k, v, doc_ids, params) -> (out, lse, saved)``: the attention output and
        LSE in the inputs' layout, and what backward reads of the LSE (``saved``, in the head
        layout); ``backward(grad_out, q, k, v, doc_ids, out, saved, params) -> (dq, dk, dv)``."""

        def forward_body(q, k, v, doc_ids, *values):
            args = (q, k, v, doc_ids, *values)
            return _computed(f"{name} forward", args, forward, q, k, v, doc_ids, _params(values))

        def backward_body(grad_out, q, k, v, doc_ids, out, saved, *values):
            inputs = (grad_out, q, k, v, doc_ids, out, saved)
            args = (*inputs, *values)
            return _computed(f"{name} backward", args, backward, *inputs, _params(values))

        tensors = "Tensor q, Tensor k, Tensor v, Tensor? doc_ids"
        forward_op = torch.library.custom_op(
            f"upipe::{name}_fwd",
            forward_body,
            mutates_args=(),
            schema=f"({tensors}, {_PARAMS_SCHEMA}) -> (Tensor, Tensor, Tensor)",
        )
        backward_op = torch.library.custom_op(
            f"upipe::{name}_bwd",
            backward_body,
            mutates_args=(),
            schema=f"(Tensor grad_out, {tensors}, Tensor out, Tensor saved, {_PARAMS_SCHEMA}) "
            "-> (Tensor, Tensor, Tensor)",
        )
        forward_op.register_fake(_fake_qkv_forward)
        backward_op.register_fake(
            lambda grad_out, q, k, v, *_: (
                torch.empty_like(q),
                torch.empty_like(k),
                torch.empty_like(v),
            )
        )
        forward_op.register_autograd(self._backward, setup_context=_setup_qkv_context)
        self.forward = OpSpec(forward_op, forward_body, _setup_qkv_context, self._backward)
        self.backward = OpSpec(backward_op, backward_body)

    def _backward(self, ctx, grad_out: Tensor, _grad_lse: Tensor | None, _saved: Tensor | None):
        q, k, v, doc_ids, out, saved = ctx.saved_tensors
        grads = call(self.backward, grad_out, q, k, v, doc_ids, out, saved, *ctx.constants)
        return (*grads, None) + (None,) * len(_PARAM_FIELDS)

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, doc_ids: Tensor | None, params: AttentionParams
    ) -> tuple[Tensor, Tensor]:
        out, lse, _ = call(self.forward, q, k, v, doc_ids, *_flat(params))
        return out, lse


def _fake_qkv_forward(q, k, v, doc_ids, *values):
    params = _params(values)
    batch, local_len, n_heads, _ = q.shape
    out = torch.empty_like(q)
    lse = q.new_empty(batch, n_heads, local_len, dtype=accumulation_dtype(q.dtype))
    saved = q.new_empty(
        n_heads // params.heads_per_stage,
        batch,
        params.query_heads_per_rank,
        local_len * params.head_degree,
        dtype=accumulation_dtype(q.dtype),
    )
    return out, lse, saved


def _setup_qkv_context(ctx, inputs, output) -> None:
    q, k, v, doc_ids, *constants = inputs
    out, _, saved = output
    ctx.save_for_backward(q, k, v, doc_ids, out, saved)
    ctx.constants = constants
    ctx.set_materialize_grads(False)  # only grad_out is ever used


def _inputs(tensors) -> tuple[Tensor, AttentionWeights, Tensor, Tensor | None]:
    """(x, weights, rope, doc_ids) from the op's tensor arguments in schema order."""
    x, *weights, rope, doc_ids = tensors
    return x, AttentionWeights(*weights), rope, doc_ids


def _fake_forward(*args):
    x, (wq, _, _, wo, *_), _, _ = _inputs(args[:_N_TENSORS])
    params = _params(args[_N_TENSORS:])
    batch, local_len, _ = x.shape
    y = x.new_empty(batch, local_len, wo.shape[0])
    out = x.new_empty(batch, local_len, wq.shape[0])
    lse = x.new_empty(
        wq.shape[0] // params.head_dim // params.heads_per_stage,
        batch,
        params.query_heads_per_rank,
        local_len * params.head_degree,
        dtype=accumulation_dtype(x.dtype),
    )
    return y, out, lse


def _fake_backward(grad_y, *args):
    x, weights, _, _ = _inputs(args[:_N_TENSORS])
    params = _params(args[_N_TENSORS + 2 :])
    return tuple(
        x.new_empty(0) if t is None or not params.needs(name) else torch.empty_like(t)
        for name, t in zip(GRADIENTS, (x, *weights))
    )


def _setup_context(ctx, inputs, output) -> None:
    tensors, constants = inputs[:_N_TENSORS], inputs[_N_TENSORS:]
    _, out, lse = output
    ctx.save_for_backward(*tensors, out, lse)
    ctx.constants = constants
    # What autograd will ask for (``ctx.needs_input_grad`` of this op's inputs; read here, since
    # the planner's transparent path runs this op inside a Function with one more input).
    ctx.needs_grads = tuple(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors[: len(GRADIENTS)]
    )
    ctx.set_materialize_grads(False)  # only grad_y is ever used: no zero-filled out/lse gradients
    if in_backward():  # a checkpoint's recompute: its output serves one backward
        storage = out.untyped_storage()
        _RECOMPUTED[id(storage)] = storage


_RECOMPUTED: weakref.WeakValueDictionary[int, torch.UntypedStorage] = weakref.WeakValueDictionary()
"""The storages of outputs made by forwards inside backward, until their backward takes them."""


def _recomputed(out: Tensor) -> bool:
    """Whether ``out`` (as backward unpacks it) was made by a forward inside backward; asked
    once."""
    storage = out.untyped_storage()
    return _RECOMPUTED.pop(id(storage), None) is storage
