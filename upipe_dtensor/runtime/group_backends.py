"""Which backend serves each device type of a process group, and what gloo cannot do with CUDA
tensors.

A backend string names one backend per device type ("cuda:nccl,cpu:gloo") or one backend for the
device types torch lists for it. gloo serves CUDA tensors in its collectives (torch 2.11:
all-to-all, all-gather, reduce-scatter, all-reduce, each staged through pinned host memory) but
not in send and receive, which hand the device pointer to gloo as if it were host memory: ranks
that share one GPU run gloo (NCCL refuses two ranks on one device), so their point-to-point
exchanges of CUDA tensors go through host copies (``stages_through_host``, the ring's ``_Shift``).

Its own module, below the config layer: the ring (``parallel``) asks it at every exchange, and
``runtime.process_group`` reads the job config.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def stages_through_host(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether send/recv of ``device`` tensors over ``group`` must be staged through host
    memory: CUDA tensors on a group whose CUDA backend is gloo (no CUDA send/recv in torch
    2.11's gloo; the pointer would go to gloo as if it were host memory)."""
    if device.type != "cuda" or group is None:
        return False
    return backend_device_types(dist.get_backend(group)).get("cuda") == "gloo"


def backend_device_types(backend: str) -> dict[str, str]:
    """Device type -> backend of a backend string: "cuda:nccl,cpu:gloo" names each; a single
    backend covers the device types torch lists for it (``Backend.backend_capability``: nccl
    cuda only, gloo cpu and cuda)."""
    if ":" in backend:
        pairs = (part.split(":", 1) for part in backend.split(","))
        return {device.strip(): name.strip() for device, name in pairs}
    return {device: backend for device in dist.Backend.backend_capability.get(backend, [])}
