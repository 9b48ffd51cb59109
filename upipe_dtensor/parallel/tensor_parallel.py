"""Tensor parallelism around the fused attention op: the op computes on this rank's heads, as
local tensors; this module turns what a tensor-parallel module holds into those and the op's
result back.

The gathering of the input and the reduction of the output are ``runtime.sharded_compute``'s.
The layout is torchtitan's (and Megatron's) for attention on a 1-D ``tp`` mesh: Q/K/V projections
column-wise (rows of whole heads: ``Shard(0)``; a fused Q/K/V weight's rows are grouped by KV
head, so a shard holds whole KV heads with their query heads), the output projection row-wise
(``Shard(1)``), per-head norm weights replicated. The module's input arrives replicated over
``tp``, or as a sequence-parallel shard (``Shard(1)``); each rank needs the whole shard of the
context-parallel rank: an all-gather, whose backward (the input's gradient is a partial sum over
the ranks' heads) is a reduce-scatter. The op's output is this rank's heads' part of ``wo``'s
product, a partial sum, reduced into the input's layout (a reduce-scatter to ``Shard(1)`` under
sequence parallelism, an all-reduce otherwise), as torchtitan's row-wise ``wo`` does. The norm
weights' gradients are partial sums too (each rank normalises its own heads).

Why not torch's ``ColwiseParallel``/``RowwiseParallel`` hooks: the fused op never calls the
projection modules, so their hooks never run; the redistributions they would make are made here,
with DTensor's own ``redistribute``, ``to_local`` and ``from_local``.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Shard,
    distribute_module,
)
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from upipe_dtensor.parallel.attention_interface import FusedQKV, ModuleWeights
from upipe_dtensor.parallel.attention_op import AttentionWeights
from upipe_dtensor.runtime.sharded_compute import REPLICATED, local_weight

_COLUMNWISE, _ROWWISE = (Shard(0),), (Shard(1),)


def _expected(weights: ModuleWeights) -> dict[str, tuple[Tensor, tuple[Placement, ...]]]:
    """name -> (tensor, the tensor-parallel placement it must have)."""
    qkv = weights.qkv
    named = (
        {"fused qkv": (qkv.weight, _COLUMNWISE)}
        if isinstance(qkv, FusedQKV)
        else {name: (w, _COLUMNWISE) for name, w in zip(("wq", "wk", "wv"), qkv)}
    )
    named["wo"] = (weights.wo, _ROWWISE)
    for name in ("q_norm", "k_norm"):
        if getattr(weights, name) is not None:
            named[name] = (getattr(weights, name), REPLICATED)
    return named


def tensor_parallel_mesh(weights: ModuleWeights) -> DeviceMesh | None:
    """The ``tp`` mesh the weights are sharded over, or None when they are whole tensors;
    ValueError for any other layout (a DTensor of ``fully_shard``'s, a 2-D mesh, another
    placement), naming the weight and the layout the styles take."""
    named = _expected(weights)
    distributed = {name for name, (t, _) in named.items() if isinstance(t, DTensor)}
    if not distributed:
        return None
    mesh = weights.wo.device_mesh if isinstance(weights.wo, DTensor) else None
    for name, (tensor, placements) in named.items():
        if (
            mesh is None
            or not isinstance(tensor, DTensor)
            or tensor.device_mesh != mesh
            or mesh.ndim != 1
            or tuple(tensor.placements) != placements
        ):
            held = (
                f"a DTensor {tuple(tensor.placements)} on mesh {tensor.device_mesh.mesh_dim_names}"
                if isinstance(tensor, DTensor)
                else "a whole tensor"
            )
            raise ValueError(
                f"{name} is {held}: the context-parallel styles take whole weights, or tensor "
                "parallelism on one 1-D mesh as torchtitan shards attention (q/k/v column-wise: "
                "Shard(0); wo row-wise: Shard(1); q/k norms replicated); apply the style before "
                "fully_shard"
            )
    return mesh


def local_weights(
    weights: ModuleWeights, head_dim: int, mesh: DeviceMesh | None
) -> AttentionWeights:
    """The op's weights of this rank: its shards as local tensors (the norm weights' gradients
    partial sums over ``tp``), a fused Q/K/V weight split into its three."""

    def local(tensor: Tensor | None, partial_grad: bool = False) -> Tensor | None:
        return tensor if tensor is None else local_weight(tensor, partial_grad=partial_grad)

    qkv = weights.qkv
    if isinstance(qkv, FusedQKV):
        wq, wk, wv = split_fused_qkv(local(qkv.weight), qkv.queries_per_kv, head_dim)
    else:
        wq, wk, wv = (local(w) for w in qkv)
    return AttentionWeights(
        wq,
        wk,
        wv,
        local(weights.wo),
        local(weights.q_norm, partial_grad=True),
        local(weights.k_norm, partial_grad=True),
    )


def split_fused_qkv(weight: Tensor, queries_per_kv: int, head_dim: int) -> list[Tensor]:
    """wq, wk, wv of a fused weight (``FusedQKV``'s row groups). Slices of the one weight (copies,
    as its rows interleave: one layer's q/k/v weights, for this call), so autograd sums the op's
    three gradients into it."""
    rows = weight.unflatten(0, (-1, queries_per_kv + 2, head_dim))
    return [w.flatten(0, 2) for w in rows.split([queries_per_kv, 1, 1], dim=1)]


class ReplicateParameters(ParallelStyle):
    """A module's parameters as DTensors replicated over the ``tp`` mesh, and no hooks: for
    weights each rank computes with on its own heads or tokens (the per-head Q/K norms inside the
    fused op), whose gradients are partial sums there that DTensor (and FSDP2) reduce over
    ``tp``. torch's ``SequenceParallel`` replicates too, but installs input and output hooks for a
    module that is called; these modules are not."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)


def attention_plan(
    projections: tuple[str, ...], wo: str, norms: tuple[str, ...] = ()
) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan of one attention module (submodule names relative to it):
    ``projections`` (Q, K, V, or the fused Q/K/V) column-wise, ``wo`` row-wise into the
    sequence-parallel shard, the per-head ``norms`` replicated (the adapters name the parts)."""
    plan: dict[str, ParallelStyle] = {name: ColwiseParallel() for name in projections}
    plan[wo] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    plan.update({name: ReplicateParameters() for name in norms})
    return plan
