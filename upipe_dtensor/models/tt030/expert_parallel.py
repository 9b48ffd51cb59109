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

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common.moe import RoutedExperts
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

from upipe_dtensor.runtime.torch_private import DataDependentOutputException

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


@contextlib.contextmanager
def balanced_routing(load: float = 1.0) -> Iterator[None]:
    """Expert-parallel exchanges sized as if the router spread every rank's routed tokens evenly
    over the experts (routed row i to expert i mod E), for the planner's fake step (``load`` > 1:
    this rank's experts receive ``load`` times that from every rank, the busiest rank of a
    skewed router; what it sends is its own tokens' share either way): how many
    tokens each rank sends and receives is read from the routing on the host, which fake tensors
    do not hold. The counts are still read on the host (one sync per MoE block, which the
    planner's rehearsal counts), so the step's syncs and the exchanges' shapes are the real
    step's under that routing; a skewed router sends some ranks more."""
    dispatch, exchange = (
        AllToAllTokenDispatcher.dispatch,
        AllToAllTokenDispatcher._sync_token_count_exchange,
    )

    def counted_dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, counts_E):
        self._planned_rows = topk_expert_ids_TK.numel()
        return dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, counts_E)

    def balanced_exchange(self, local_counts_E, global_counts_EP_e, ep_size):
        try:  # the real step's one host read of the counts (a fake tensor has no value)
            global_counts_EP_e.sum().item()
        except DataDependentOutputException:
            pass
        rows, experts = self._planned_rows, local_counts_E.shape[0]
        per_expert = [rows // experts + (e < rows % experts) for e in range(experts)]
        local = experts // ep_size
        even = per_expert[self.ep_mesh.get_local_rank() * local :][:local]
        mine = [round(count * load) for count in even]
        sent = [sum(per_expert[p * local : (p + 1) * local]) for p in range(ep_size)]
        received = global_counts_EP_e.new_tensor(mine * ep_size).reshape(-1)
        return received, sent, [sum(mine)] * ep_size

    AllToAllTokenDispatcher.dispatch = counted_dispatch
    AllToAllTokenDispatcher._sync_token_count_exchange = balanced_exchange
    try:
        yield
    finally:
        AllToAllTokenDispatcher.dispatch = dispatch
        AllToAllTokenDispatcher._sync_token_count_exchange = exchange
