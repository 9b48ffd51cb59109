"""Register an attention op (UPipe/ring, FPDT) as one opaque custom-op pair, forward and backward.

``torch.compile(fullgraph=True)`` then sees a single node per layer, which it cannot split into
whole-sequence tensors, and the fake implementations give it the output shapes. Every attention
op has the same tensors in and out, and differs only in its plain-value constants, so the schema is
built here once:

    forward (x, wq, wk, wv, wo, rope, doc_ids?, *constants) -> (y, out, lse)
    backward(grad_y, x, wq, wk, wv, wo, rope, doc_ids?, out, lse, *constants)
             -> (grad_x, grad_wq, grad_wk, grad_wv, grad_wo)

``y = out @ wo.T`` is the layer's output; ``out`` (the pre-``wo`` attention output) and ``lse``
(one log-sum-exp per head and token, float32) are saved for backward. Taking ``wo`` inside lets
backward form each stage's slice of the pre-``wo`` gradient from ``grad_y`` directly, so the whole
(tokens, H*d) gradient is never materialised. Every constants schema has ``cp_size``,
``head_dim`` and ``heads_per_stage``, which the fake forward needs.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..kernels.op_mode import OpSpec, call

_TENSORS = "Tensor x, Tensor wq, Tensor wk, Tensor wv, Tensor wo, Tensor rope, Tensor? doc_ids"


class AttentionOp:
    """A registered attention op: ``op(x, wq, wk, wv, wo, rope, doc_ids, *constants) -> y``."""

    def __init__(self, name: str, constants: str, forward: Callable, backward: Callable) -> None:
        """``constants`` is the schema of the op's plain-value arguments, e.g.
        ``"str group_name, int cp_size, int head_dim, int heads_per_stage, float scale"``."""
        self.constant_names = [item.split()[-1] for item in constants.split(", ")]
        forward_op = torch.library.custom_op(
            f"upipe::{name}_fwd", lambda *args: forward(*args), mutates_args=(),
            schema=f"({_TENSORS}, {constants}) -> (Tensor, Tensor, Tensor)",
        )
        backward_op = torch.library.custom_op(
            f"upipe::{name}_bwd", lambda *args: backward(*args), mutates_args=(),
            schema=f"(Tensor grad_y, {_TENSORS}, Tensor out, Tensor lse, {constants}) "
            f"-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        )
        forward_op.register_fake(self._fake_forward)
        backward_op.register_fake(_fake_backward)
        forward_op.register_autograd(self._backward, setup_context=_setup_context)
        self.forward = OpSpec(forward_op, forward, _setup_context, self._backward)
        self.backward = OpSpec(backward_op, backward)

    def _fake_forward(self, x, wq, wk, wv, wo, rope, doc_ids, *constants):
        named = dict(zip(self.constant_names, constants))
        cp_size, head_dim, heads_per_stage = named["cp_size"], named["head_dim"], named["heads_per_stage"]
        batch, local_len, _ = x.shape
        y = x.new_empty(batch, local_len, wo.shape[0])
        out = x.new_empty(batch, local_len, wq.shape[0])
        lse = x.new_empty(
            wq.shape[0] // head_dim // heads_per_stage, batch, heads_per_stage // cp_size,
            local_len * cp_size, dtype=torch.float32,
        )
        return y, out, lse

    def _backward(self, ctx, grad_y: Tensor, _grad_out: Tensor | None, _grad_lse: Tensor | None):
        x, wq, wk, wv, wo, rope, doc_ids, out, lse = ctx.saved_tensors
        grads = call(self.backward, grad_y, x, wq, wk, wv, wo, rope, doc_ids, out, lse, *ctx.constants)
        return (*grads, None, None) + (None,) * len(self.constant_names)

    def __call__(self, *args) -> Tensor:
        y, _, _ = call(self.forward, *args)
        return y


def _fake_backward(grad_y, x, wq, wk, wv, wo, *args):
    return tuple(torch.empty_like(t) for t in (x, wq, wk, wv, wo))


def _setup_context(ctx, inputs, output) -> None:
    x, wq, wk, wv, wo, rope, doc_ids, *constants = inputs
    _, out, lse = output
    ctx.save_for_backward(x, wq, wk, wv, wo, rope, doc_ids, out, lse)
    ctx.constants = constants
    ctx.set_materialize_grads(False)  # only grad_y is ever used: no zero-filled out/lse gradients
