"""The one path that turns a job config into a parallelised model on its device.

``train.py`` (through ``Trainer``), ``evaluate`` and ``convert`` all build their model here, so a
model evaluated or exported is laid out, sharded and loaded exactly as the one trained: the job is
checked, the process group and the (dp_shard, cp) meshes are set up, the model is built on the
meta device, the CP style, memory stack and FSDP2 are applied, and only then is this rank's shard
materialised (never the whole model on one rank).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .config import ConfigError, JobConfig, check_job
from .data import Tokenizer, build_tokenizer
from .memory.offload import HostOffload
from .models import FLAVORS, Llama3, build_llama3, init_sharded_weights
from .parallel import UPipeAttention
from .parallelize import ParallelMeshes, build_meshes, parallelize_llama


def pick_device() -> tuple[torch.device, str]:
    """This process's device and process-group backend: its CUDA device under torchrun, else CPU."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


@dataclass
class ParallelModel:
    """A built, parallelised model with what its users need to feed it."""

    config: JobConfig
    model: Llama3
    tokenizer: Tokenizer
    device: torch.device
    meshes: ParallelMeshes
    cp_style: UPipeAttention
    """Its ``shard_positions`` says which tokens of a sequence this CP rank feeds."""
    host_offload: HostOffload | None
    world_size: int
    dp: int
    dp_rank: int
    cp: int
    cp_rank: int

    def shard_sequence(self, batch: Tensor) -> Tensor:
        """This CP rank's tokens of every sequence (dim 1), in the order its CP style expects."""
        positions = self.cp_style.shard_positions(batch.shape[1], self.cp_rank, self.cp)
        return batch.index_select(1, positions.to(batch.device)).to(self.device)


def build_parallel_model(
    config: JobConfig,
    *,
    meshes: ParallelMeshes | None = None,
    device: torch.device | None = None,
    host_device: torch.device = torch.device("cpu"),
    mixed_precision: bool | None = None,
) -> ParallelModel:
    """Check ``config``, set up the process group and meshes, build and parallelise the model,
    and fill it with the seed's initial weights (sharded; loaders overwrite them afterwards).

    By default the device is picked (CUDA if present) and the meshes are built. The memory
    planner passes its own: meshes built before entering a FakeTensorMode (which cannot build
    one), a device, a stand-in ``host_device`` for offloaded activations, and
    ``mixed_precision=True`` to model a GPU run (default: mixed precision on CUDA only).
    """
    world_size = (
        dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    )
    dp = check_job(config, world_size)  # before any process group or allocation
    tokenizer = build_tokenizer(config.model.tokenizer_path)
    flavor = config.model.flavor
    if tokenizer.vocab_size > FLAVORS[flavor].vocab_size:
        raise ConfigError(
            f"{config.config_file or 'command line'}: the tokenizer at "
            f"{config.model.tokenizer_path} has {tokenizer.vocab_size} tokens, more than flavor "
            f"{flavor!r}'s vocab_size {FLAVORS[flavor].vocab_size}"
        )
    if config.memory.expandable_segments:
        # Before the first CUDA allocation; a user's own setting wins.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if device is None:
        device, backend = pick_device()
        if not dist.is_initialized():
            dist.init_process_group(backend)
    meshes = meshes or build_meshes(device.type, dp, config.parallelism.context_parallel_degree)

    with torch.device("meta"):
        model = build_llama3(flavor, seq_len=config.training.seq_len)
    parallelized = parallelize_llama(model, meshes, config, device, host_device, mixed_precision)
    model.to_empty(device=device)
    init_sharded_weights(model, seed=config.training.seed, device=device)
    return ParallelModel(
        config=config,
        model=model,
        tokenizer=tokenizer,
        device=device,
        meshes=meshes,
        cp_style=parallelized.cp_style,
        host_offload=parallelized.host_offload,
        world_size=world_size,
        dp=dp,
        dp_rank=meshes.dp_shard.get_local_rank(),
        cp=config.parallelism.context_parallel_degree,
        cp_rank=meshes.cp.get_local_rank(),
    )
