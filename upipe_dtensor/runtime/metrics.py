"""One readable log line per step, and the same scalars as tensorboard events (rank 0 only)."""

from __future__ import annotations

import os
import resource

import torch

PEAK_BF16_FLOPS = {
    # Dense bf16 peak FLOP/s by the exact name torch.cuda.get_device_name reports, from NVIDIA's
    # data sheets: H100 SXM5 989.4 TFLOP/s, H100 PCIe 756, H100 NVL 835 (per GPU), H200 SXM 989,
    # A100 (SXM4 and PCIe) 312, B200 2250. Another part (an H100 variant, a name not listed)
    # reports no MFU rather than a wrong one.
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA B200": 2250e12,
}


def peak_flops(device: torch.device) -> tuple[float | None, str]:
    """The device's dense bf16 peak for MFU (None when unknown) and why not, for the log."""
    if device.type != "cuda":
        return None, "n/a"
    name = torch.cuda.get_device_name(device)
    peak = PEAK_BF16_FLOPS.get(name)
    return peak, "" if peak else f"n/a (unknown GPU {name})"


def peak_memory_bytes(device: torch.device) -> tuple[int, int | None]:
    """(peak allocated, peak reserved): CUDA's caching allocator, whose reserved memory is what
    the GPU really gives up; on CPU the process's peak resident set and no reserved figure."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None  # Linux: KiB


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
        self.peak, self.no_mfu = peak_flops(device)
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
        }
        allocated, reserved = peak_memory_bytes(self.device)
        scalars["memory_peak_gib"] = allocated / 2**30
        if reserved is not None:
            scalars["memory_reserved_gib"] = reserved / 2**30
        if host_offload_bytes is not None:
            scalars["host_offload_gib"] = host_offload_bytes / 2**30
        if self.peak is not None:
            scalars["mfu_percent"] = 100 * self.flops_per_token * tokens_per_device / self.peak
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, step)
        if step % self.log_freq == 0 or step == 1:
            mfu = f"{scalars['mfu_percent']:.1f}%" if "mfu_percent" in scalars else self.no_mfu
            memory = f"mem {scalars['memory_peak_gib']:.2f} GiB" + (
                f" (reserved {scalars['memory_reserved_gib']:.2f} GiB)"
                if reserved is not None
                else ""
            )
            print(
                f"step {step:5d} | loss {loss:.4f} | grad_norm {grad_norm:.3f} | lr {lr:.2e} | "
                f"tok/s/dev {tokens_per_device:,.0f} | mfu {mfu} | {memory}"
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
