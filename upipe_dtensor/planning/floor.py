"""What a training step needs before its first activation, worked out in seconds without tracing:
the planner refuses a search whose answer cannot be anything but "nothing fits".

Each GPU always holds CUDA's fixed allowances (``CudaAllowances``: context, NCCL buffers per
communicator, cuBLAS workspace) and, unless FSDP CPU offload moves them to the host, its shard of
the model states: float32 parameters, gradients and AdamW's two moments, 16 bytes per parameter
spread over every rank. No sequence length, however short, needs less; a search for the longest
context on a budget below that floor would plan length after length, for minutes, to say nothing
fits (the issue this answers: 11 minutes for ``--device-memory-gib 1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from upipe_dtensor.config import JobConfig
from upipe_dtensor.errors import DoesNotFit
from upipe_dtensor.models import family_of
from upipe_dtensor.models.hf_config import model_args
from upipe_dtensor.planning.step import (
    FIXED_ALLOWANCES,
    Budget,
    CudaAllowances,
    GiB,
    nccl_communicators,
)

MODEL_STATE_BYTES_PER_PARAMETER = 16
"""float32 parameter, gradient, AdamW exp_avg and exp_avg_sq (FSDP2 keeps all four sharded)."""


@dataclass(frozen=True)
class MemoryFloor:
    """The least memory a job's step needs, per GPU and per node, before any activation."""

    allowances: dict[str, int]
    """CUDA's fixed allowances on each GPU, by label."""
    parameters: int
    world_size: int
    ranks_per_node: int

    @property
    def model_state_bytes(self) -> int:
        """This rank's shard of the model states."""
        return self.parameters * MODEL_STATE_BYTES_PER_PARAMETER // self.world_size

    def device_bytes(self, fsdp_cpu_offload: bool) -> int:
        states = 0 if fsdp_cpu_offload else self.model_state_bytes
        return sum(self.allowances.values()) + states

    def host_bytes_per_node(self, fsdp_cpu_offload: bool) -> int:
        return self.model_state_bytes * self.ranks_per_node if fsdp_cpu_offload else 0

    def problems(self, budget: Budget, fsdp_cpu_offload: bool) -> list[str]:
        """Why nothing can fit ``budget`` with this offload setting (empty: the floor fits)."""
        found = []
        device = self.device_bytes(fsdp_cpu_offload)
        if device > budget.device_bytes:
            parts = [f"{label} {nbytes / GiB:.2f}" for label, nbytes in self.allowances.items()]
            if not fsdp_cpu_offload:
                parts.append(f"model states {self.model_state_bytes / GiB:.2f}")
            found.append(
                f"each GPU needs {device / GiB:.2f} GiB before any activation ("
                + ", ".join(parts)
                + f" GiB), more than its {budget.device_bytes / GiB:g} GiB"
            )
        host = self.host_bytes_per_node(fsdp_cpu_offload)
        if host > budget.host_bytes_per_node:
            found.append(
                f"the model states offloaded to the host need {host / GiB:,.1f} GiB per node, more "
                f"than its {budget.host_bytes_per_node / GiB:g} GiB"
            )
        return found


def parameter_count(config: JobConfig) -> int:
    """The model's parameters, counted on the meta device (no memory, a second for 32B)."""
    with torch.device("meta"):
        args = model_args(config.model, config.training.seq_len)
        model = family_of(args).model_class(args)
    return sum(p.numel() for p in model.parameters())


def memory_floor(config: JobConfig, world_size: int, budget: Budget) -> MemoryFloor:
    """The floor of ``config`` (laid out on its world: the CP axes set) on ``world_size`` GPUs."""
    allowances = CudaAllowances().rows(0, nccl_communicators(config, world_size))
    return MemoryFloor(
        {k: nbytes for k, nbytes in allowances.items() if k.startswith(FIXED_ALLOWANCES)},
        parameter_count(config),
        world_size,
        min(world_size, budget.gpus_per_node),
    )


def refuse_impossible(
    config: JobConfig, world_size: int, budget: Budget, offload_choices: tuple[bool, ...]
) -> None:
    """``DoesNotFit``, before any plan, when the floor exceeds ``budget`` with each FSDP CPU offload
    setting the search may use; names what fills the memory and what to change."""
    floor = memory_floor(config, world_size, budget)
    reasons = {offload: floor.problems(budget, offload) for offload in offload_choices}
    if all(reasons.values()):
        said = " | ".join(
            f"{'with' if offload else 'without'} FSDP CPU offload: {'; '.join(why)}"
            for offload, why in reasons.items()
        )
        raise DoesNotFit(
            f"nothing can fit: {said} (model states: {floor.parameters:,} parameters x 16 "
            f"bytes over {world_size} GPUs). Give each GPU more memory (--device-memory-gib) or "
            "the nodes more (--host-memory-gib), use more GPUs (--world-size) to share the "
            "model states, or plan a smaller model"
        )
