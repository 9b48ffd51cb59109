"""The package's one table of dense bf16 peak FLOP/s per GPU: MFU's denominator, for the step log
(``runtime.metrics``) and the planner's GPU profiles (``planning.hardware``)."""

from __future__ import annotations

import torch

PEAK_BF16_FLOPS = {
    # Dense bf16 peak FLOP/s by the exact name torch.cuda.get_device_name reports, from NVIDIA's
    # data sheets: H100 SXM5 989.4 TFLOP/s (528 tensor cores x 1024 FLOP per clock x 1.83 GHz, as
    # torchtitan's get_peak_flops), H100 PCIe 756, H100 NVL 835 (per GPU), H200 SXM 989 (the
    # H100's compute), A100 (SXM4 and PCIe) 312, B200 2250. Another part (an H100 variant, a name
    # not listed) reports no MFU rather than a wrong one.
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
