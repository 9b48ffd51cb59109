"""How a training job updates its weights: AdamW from ``[optimizer]``, the learning-rate
schedule from ``[lr_scheduler]`` (warmup, then linear or cosine decay to a floor), and a
mixture of experts' load balancing at each step."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.lr_scheduler import LambdaLR

from upipe_dtensor.config import JobConfig


def build_optimizer(model: nn.Module, config: JobConfig, device: torch.device) -> torch.optim.AdamW:
    opt = config.optimizer
    return torch.optim.AdamW(
        model.parameters(),
        lr=opt.lr,
        betas=(opt.beta1, opt.beta2),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        # The fused kernel needs the parameters on the GPU (not so under FSDP CPU offload).
        fused=device.type == "cuda" and not config.training.enable_cpu_offload,
    )


class _TokenMeshes:
    """What torchtitan's load-balancing hook asks of its ``ParallelDims``: the mesh over which
    a step's tokens are split (its "loss" mesh: dp_shard x cp here), and no expert parallelism
    inside tensor parallelism."""

    ep_enabled = False
    tp = 1

    def __init__(self, token_mesh: DeviceMesh) -> None:
        self.token_mesh = token_mesh

    def get_optional_mesh(self, name: str) -> DeviceMesh | None:
        return self.token_mesh if name == "loss" else None


def balance_experts(optimizer: torch.optim.Optimizer, model: nn.Module, token_mesh: DeviceMesh):
    """torchtitan's auxiliary-loss-free load balancing on ``optimizer``: before each step every
    MoE block's expert bias moves toward its under-used experts, by the tokens it routed on
    all the ranks of ``token_mesh``. Nothing for a dense model."""
    if not any(getattr(block, "moe_enabled", False) for block in model.layers.values()):
        return
    # Imported here: only a mixture of experts (torchtitan 0.3.0's) needs it.
    from torchtitan.components.optimizer import register_moe_load_balancing_hook

    register_moe_load_balancing_hook(optimizer, [model], _TokenMeshes(token_mesh))


def lr_lambda(config: JobConfig) -> Callable[[int], float]:
    """Linear warmup to the peak, then linear or cosine decay to ``min_lr_factor`` at the end."""
    warmup = config.lr_scheduler.warmup_steps
    total = config.training.steps
    decay_type = config.lr_scheduler.decay_type
    floor = config.lr_scheduler.min_lr_factor

    def factor(step: int) -> float:  # LambdaLR's step counts completed optimizer steps
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        shape = 1 - progress if decay_type == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * shape

    return factor


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: JobConfig) -> LambdaLR:
    return LambdaLR(optimizer, lr_lambda(config))


def follow_schedule(scheduler: LambdaLR, config: JobConfig) -> None:
    """Set the learning rate from this job's schedule at the step a snapshot resumed: the
    snapshot holds the rate its own ``[training] steps`` gave, which differs once steps is
    raised."""
    factor = lr_lambda(config)(scheduler.last_epoch)
    for group, base_lr in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
        group["lr"] = base_lr * factor
