"""One readable log line per step, and the same scalars as tensorboard events (rank 0 only)."""

from __future__ import annotations

import os
import resource

import torch

# Dense bf16 peak FLOP/s by device name, for MFU; devices not listed report no MFU.
_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in _PEAK_FLOPS.items() if key in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated by the caching allocator. CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class MetricsLogger:
    def __init__(
        self,
        *,
        log_dir: str | None,
        log_freq: int,
        device: torch.device,
        flops_per_token: float,
        world_size: int,
        enabled: bool,
        first_step: int = 1,
    ) -> None:
        """``first_step``: the step this run starts at; tensorboard hides events of earlier runs
        from that step on, so the steps a resumed job replays appear once."""
        self.log_freq = log_freq
        self.device = device
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.enabled = enabled
        self.peak = peak_flops(device)
        self.writer = None
        if enabled and log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(log_dir, exist_ok=True)
            self.writer = SummaryWriter(log_dir, purge_step=first_step)

    def log(
        self,
        step: int,
        *,
        loss: float,
        grad_norm: float,
        lr: float,
        tokens: int,
        seconds: float,
        host_offload_bytes: int | None = None,
    ) -> None:
        """``tokens``: all tokens of the step over all ranks; ``seconds``: the step's wall time;
        ``host_offload_bytes``: peak host memory held by activation offload, if it is on."""
        if not self.enabled:
            return
        tokens_per_device = tokens / seconds / self.world_size
        scalars = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_second_per_device": tokens_per_device,
            "memory_peak_gib": peak_memory_bytes(self.device) / 2**30,
        }
        if host_offload_bytes is not None:
            scalars["host_offload_gib"] = host_offload_bytes / 2**30
        if self.peak is not None:
            scalars["mfu_percent"] = 100 * self.flops_per_token * tokens_per_device / self.peak
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, step)
        if step % self.log_freq == 0 or step == 1:
            mfu = f"{scalars['mfu_percent']:.1f}%" if "mfu_percent" in scalars else "n/a"
            print(
                f"step {step:5d} | loss {loss:.4f} | grad_norm {grad_norm:.3f} | lr {lr:.2e} | "
                f"tok/s/dev {tokens_per_device:,.0f} | mfu {mfu} | "
                f"mem {scalars['memory_peak_gib']:.2f} GiB"
                + (
                    f" | host offload {scalars['host_offload_gib']:.2f} GiB"
                    if host_offload_bytes is not None
                    else ""
                ),
                flush=True,
            )

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
