"""What a job has before its model: where its tensors live (``Placement``), its meshes
(``ParallelMeshes``) and the checked job with its process group (``JobSetup``).

Its own module because both halves of the assembly read it: ``build`` makes a ``JobSetup``
(``set_up_job``) and ``parallelize`` lays the model out from one, and ``build`` calls
``parallelize``; the planner makes a ``Placement`` for its fake ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from upipe_dtensor.config import JobConfig
from upipe_dtensor.data.loader import Tokenizer
from upipe_dtensor.models.hf_config import ModelArgs


@dataclass(frozen=True)
class ParallelMeshes:
    """The (dp_shard, cp_ring, cp_heads, tp) world mesh, its flattened cp and dp_shard x cp
    meshes, and its tp mesh.

    Tensor parallelism is innermost, as torchtitan lays it out (its collectives run in every
    block, on one node's NVLink), then the head axis (the all-to-alls, inside a node too), the
    ring axis across nodes; without a ring axis (ring degree 1) cp is the head axis. FSDP2 shards
    over dp_shard x cp; the tp ranks hold their own shards of the tensor-parallel weights.
    """

    world: DeviceMesh
    fsdp: DeviceMesh
    cp: DeviceMesh
    """All C context-parallel ranks of one sequence, in (ring, heads) order."""
    experts: DeviceMesh | None = None
    """The (efsdp, ep) mesh of expert parallelism over every rank (no tensor parallelism):
    groups of ``ep`` consecutive ranks, the innermost axes of dp_shard x cp (a sequence's head
    ranks first), hold every expert once between them; ``efsdp`` strides across the groups
    (``models.tt030.expert_parallel``). None without expert parallelism."""

    @property
    def tp(self) -> DeviceMesh:
        """The T tensor-parallel ranks of one context-parallel rank."""
        return self.world["tp"]

    @property
    def dp_shard(self) -> DeviceMesh:
        return self.world["dp_shard"]

    @property
    def cp_2d(self) -> DeviceMesh:
        """The (cp_ring, cp_heads) mesh of 2D context parallelism."""
        return self.world["cp_ring", "cp_heads"]

    def describe_rank_groups(self) -> str:
        """The 2D layout in global ranks, for the start-up log: the head groups (all-to-all)
        should each be one node's ranks and every ring group should join the nodes; torchrun
        numbers ranks node by node, so a wrong launch shows here."""
        ranks = self.world.mesh[..., 0]  # (dp_shard, cp_ring, cp_heads) global ranks of tp 0
        dp, ring, heads = ranks.shape
        return (
            f"mesh dp_shard {dp} x cp_ring {ring} x cp_heads {heads}: head groups (all-to-all, "
            f"inside a node) {ranks.flatten(0, 1).tolist()}, ring groups (across nodes) "
            f"{ranks.transpose(1, 2).flatten(0, 1).tolist()}"
        )


def build_meshes(
    device_type: str, dp_shard: int, cp: int, ring: int = 1, tp: int = 1, ep: int = 1
) -> ParallelMeshes:
    """Every mesh of a job, built at once (a fake step cannot build one: ``Placement``)."""
    world = init_device_mesh(
        device_type,
        (dp_shard, ring, cp // ring, tp),
        mesh_dim_names=("dp_shard", "cp_ring", "cp_heads", "tp"),
    )
    return ParallelMeshes(
        world=world,
        fsdp=world["dp_shard", "cp_ring", "cp_heads"]._flatten("dp_shard_cp"),
        cp=world["cp_ring", "cp_heads"]._flatten("cp"),
        experts=(
            init_device_mesh(device_type, (world.size() // ep, ep), mesh_dim_names=("efsdp", "ep"))
            if ep > 1
            else None
        ),
    )


@dataclass(frozen=True)
class Placement:
    """Where a job's tensors live, when the caller decides instead of the job.

    A real job leaves every field at its default: it picks its device (CUDA if present), builds
    its meshes, parks offloaded activations on the CPU and computes in mixed precision on CUDA
    only. The memory planner decides all of it once, here: meshes built before entering a
    FakeTensorMode (which cannot build one), a device, a stand-in host device it counts as host
    memory, and mixed precision on to model a GPU run with CPU stand-in tensors.
    """

    meshes: ParallelMeshes | None = None
    device: torch.device | None = None
    host_device: torch.device = torch.device("cpu")
    mixed_precision: bool | None = None
    """None: on CUDA only."""
    kernel_device: str | None = None
    """The planner's "cuda": choose the CUDA kernels while the tensors are fake CPU ones, so the
    GPU step's kernel calls are traced (None: the kernels of the job's own device)."""
    n_layers: int | None = None
    """The planner's reduced-depth trace (``planning.depth``): build the model with this many
    blocks (None: the model's own)."""


@dataclass(frozen=True)
class JobSetup:
    """What exists before the model: the checked job, its tokenizer, process group and meshes.
    A caller (the trainer) can check the data and the snapshot to resume from here, before the
    expensive part."""

    config: JobConfig
    args: ModelArgs
    tokenizer: Tokenizer
    device: torch.device
    host_device: torch.device
    mixed_precision: bool
    kernel_device: str
    """The device type the attention kernels are chosen for ("cuda" when the planner traces a
    GPU run on fake CPU tensors)."""
    attention_backend: str
    """[parallelism] attention_backend resolved for ``kernel_device``."""
    attention_choice: str
    """The backend in words for the start-up line: with ``auto``, why faster ones were skipped."""
    meshes: ParallelMeshes
    world_size: int
    dp: int
    dp_rank: int
    cp: int
    cp_rank: int
    tp: int = 1
    tp_rank: int = 0


def holds_host_tensors(config: JobConfig) -> bool:
    """Whether a job of ``config`` keeps tensors that collectives meet in host memory (FSDP2 CPU
    offload: the sharded parameters, their gradients and the optimizer state)."""
    return config.training.enable_cpu_offload
