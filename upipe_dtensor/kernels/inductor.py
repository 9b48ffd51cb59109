"""The project's custom ops in inductor-compiled blocks: registered as inductor fallbacks before
any block is lowered.

Inductor lowers a custom op it has not seen yet into an eager fallback at the moment it meets the
op in a graph, and only then adds it to the ops whose inputs it materialises
(``torch._inductor.lowering.needs_realized_inputs``). The node that *produces* such an input was
lowered just before, when the op was not registered yet, so a pointwise input with several users
is not materialised once: inductor copies it into the op's input buffer and recomputes it for its
other users from its own inputs, which then stay alive across the op. In a block's backward the
residual gradient ``grad_h = grad_out + rms_norm_bwd(...)`` feeds the attention backward and the
final residual sum; the recompute kept ``grad_out`` and the norm's gradient, two (S/C, D) hidden
states, alive through the attention backward (measured: 73.65 against 65.65 MiB on the debug
step, ``docs/measurements.md``). Registering every ``torch.ops.upipe`` op up front, with the same
fallback and layout constraint inductor's implicit fallback gives it, makes the producer see its
consumer and materialise the sum once (cf. pytorch/pytorch#105768 for the same cost on a
residual add that inductor left inline).
"""

from __future__ import annotations

from upipe_dtensor.kernels.op_mode import project_ops


def register_inductor_fallbacks() -> None:
    """Register every project op with inductor as the fallback (eager call) it would get on first
    use; ops inductor already lowers are left alone. Call before compiling."""
    from upipe_dtensor.runtime.torch_private import (
        get_layout_constraint_tag,
        lowerings,
        make_fallback,
        tag_to_layout_constraint,
    )

    for op in project_ops():
        if op not in lowerings:
            constraint = tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
            make_fallback(op, layout_constraint=constraint, warn=False)
