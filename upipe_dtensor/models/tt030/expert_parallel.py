"""Expert parallelism for torchtitan 0.3.0's mixture of experts (``MoE``), over an ``ep`` mesh,
as torchtitan composes it: each rank of a group of E holds num_experts / E of every block's
experts (the grouped weights ``Shard(0)`` over ``ep``), and each block's token dispatcher,
torchtitan's ``AllToAllTokenDispatcher`` (a local reorder while it has no mesh), sends every
routed token to the rank holding its expert and brings the result back. The groups are
consecutive ranks of dp_shard x cp (``train.setup.ParallelMeshes.experts``); FSDP2 shards each
rank's experts over the ranks outside its group (``efsdp``), the rest of the model over all of
dp_shard x cp (``train.parallelize``).

torchtitan applies the same layout through its ``ParallelDims`` and module sharding configs;
this project's meshes are its own (``train.setup``), so the two steps it takes (the weights'
placement and ``wire_meshes``) are taken here directly.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common.moe import RoutedExperts

_BACKEND = "partial_dtensor"
"""torchtitan's SPMD backend of plain DTensors, the one this project's models run on: the
dispatcher exchanges tokens over its own ``ep_mesh`` under it (under torchtitan's default,
``spmd_types``, it asks for a current mesh that only torchtitan's trainer sets)."""


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> list[nn.Module]:
    """Split every MoE block's experts over ``mesh["ep"]`` and route its tokens there; returns
    the grouped-experts modules, which FSDP2 shards over ``mesh["efsdp"]``."""
    set_spmd_backend(_BACKEND)
    ep_mesh, experts = mesh["ep"], []
    for module in model.modules():
        if not isinstance(module, RoutedExperts):
            continue
        inner = module.inner_experts
        for name, param in list(inner.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, ep_mesh, [Shard(0)])
            inner.register_parameter(name, nn.Parameter(sharded, param.requires_grad))
        module.token_dispatcher.wire_meshes(ep_mesh=ep_mesh)
        experts.append(inner)
    return experts
