"""Computing on each tensor-parallel rank's part of a module, as local tensors: its sequence-
parallel input gathered, its partial output reduced, a per-token op run on the local shard.

The memory stack's and the attention styles' ops are custom ops on plain tensors (one opaque node
each for ``torch.compile``); under tensor parallelism the modules they replace hold DTensor
weights and receive DTensor activations (torch's ``SequenceParallel`` norms hand on a
``Shard(1)`` DTensor). These helpers make the layout changes DTensor's own redistributions make
for torch's ``ColwiseParallel``/``RowwiseParallel``, around a computation that never calls those
modules' hooks:

- ``gathered_input``: the whole sequence of this rank's shard, all-gathered from a
  sequence-parallel input; its gradient (a partial sum over the ranks' heads or MLP columns) is
  reduce-scattered back.
- ``reduced_output``: a partial sum (this rank's rows of a row-wise weight) summed over ``tp`` into
  the layout the input arrived in: a DTensor, as the residual stream between the blocks is one
  under sequence parallelism (torchtitan's layout), or a plain tensor for a plain input.
- ``local_shard_op``: a per-token op (a norm) on the local rows of a sequence-parallel input, its
  replicated weight's gradient a partial sum that DTensor (and FSDP2) reduce.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

REPLICATED = (Replicate(),)


def gathered_input(x: Tensor, mesh: DeviceMesh | None) -> Tensor:
    """``x`` as this rank computes with it: whole over ``tp`` (all-gathered from a sequence-
    parallel DTensor; a plain tensor is taken as replicated), its gradient reduced back into
    ``x``'s layout. ``mesh`` None: ``x`` as it is."""
    if mesh is None:
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, REPLICATED, run_check=False)
    return x.redistribute(mesh, REPLICATED).to_local(grad_placements=(Partial(),))


def reduced_output(y: Tensor, given: Tensor, mesh: DeviceMesh | None) -> Tensor:
    """The module's output from a partial sum ``y``: summed over ``tp`` into the layout the input
    ``given`` arrived in (a reduce-scatter to the sequence-parallel shard, or an all-reduce): a
    DTensor for a DTensor input, a plain tensor for a plain one. ``mesh`` None: ``y``."""
    if mesh is None:
        return y
    partial = DTensor.from_local(y, mesh, (Partial(),), run_check=False)
    if isinstance(given, DTensor):
        return partial.redistribute(mesh, given.placements)
    return partial.redistribute(mesh, REPLICATED).to_local()


def local_weight(weight: Tensor, *, partial_grad: bool = False) -> Tensor:
    """A DTensor weight's local part (a plain tensor as it is); ``partial_grad``: the weight is
    replicated and this rank's gradient is a partial sum (of its own heads or tokens)."""
    if not isinstance(weight, DTensor):
        return weight
    return weight.to_local(grad_placements=(Partial(),) if partial_grad else None)


def local_shard_op(op: Callable[[Tensor, Tensor], Tensor], x: Tensor, weight: Tensor) -> Tensor:
    """``op(x, weight)`` for a per-token op: on a sequence-parallel DTensor ``x``, on its local
    rows with the replicated ``weight``'s local copy, the result a DTensor of ``x``'s layout."""
    if not isinstance(x, DTensor):
        return op(x, weight)
    out = op(x.to_local(), local_weight(weight, partial_grad=True))
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)
