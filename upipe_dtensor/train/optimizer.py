"""How a training job updates its weights: AdamW from ``[optimizer]`` and the learning-rate
schedule from ``[lr_scheduler]`` (warmup, then linear or cosine decay to a floor)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
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
