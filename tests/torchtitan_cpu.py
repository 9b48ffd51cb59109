"""What torchtitan's own ``Trainer`` needs to train on CPU gloo ranks (0.2.2 and 0.3.0), patched
in the rank processes of the plug-in tests only; the plug-in needs none of it on GPUs.

- device detection: ``tools/utils.py`` falls back to "cuda" without an accelerator; the modules
  that copied ``device_type`` / ``device_module`` at import get "cpu" and a device module whose
  memory statistics are empty;
- FSDP's gradient reduction: torchtitan sets a gradient divide factor, which FSDP2 reduces with
  PREMUL_SUM, which gloo lacks: FSDP sums, then divides;
- torchtitan 0.3.0's trainer calls ``torch.distributed.set_timeout`` after its first step,
  which torch 2.13 does not have: torch's private ``_set_pg_timeout`` does what it asks;
- the LOCAL_RANK torchrun would set.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator
from unittest import mock

import torch


@contextlib.contextmanager
def torchtitan_on_cpu(rank: int) -> Iterator[None]:
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools
    from torch.distributed.distributed_c10d import _set_pg_timeout
    from torch.distributed.fsdp import FSDPModule

    cpu = types.SimpleNamespace(
        set_device=torch.cpu.set_device,
        synchronize=torch.cpu.synchronize,
        current_device=lambda: 0,  # an index, as barrier(device_ids=...) takes
        device_count=lambda: 1,
        get_device_name=lambda *_: "cpu",
        get_device_properties=lambda *_: types.SimpleNamespace(total_memory=1),
        reset_peak_memory_stats=lambda *_: None,
        empty_cache=lambda: None,
        memory_stats=lambda *_: {},  # torchtitan reads absent statistics as -1
    )
    set_divide_factor = FSDPModule.set_gradient_divide_factor

    def sum_then_divide(module: FSDPModule, factor: float) -> None:
        set_divide_factor(module, factor)
        module.set_force_sum_reduction_for_comms(True)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, LOCAL_RANK=str(rank)))
        for module in (tools, dist_utils, metrics):
            stack.enter_context(mock.patch.object(module, "device_type", "cpu"))
            stack.enter_context(mock.patch.object(module, "device_module", cpu))
        stack.enter_context(mock.patch.object(parallel_dims, "device_type", "cpu"))
        stack.enter_context(
            mock.patch.object(FSDPModule, "set_gradient_divide_factor", sum_then_divide)
        )
        if not hasattr(torch.distributed, "set_timeout"):
            stack.enter_context(
                mock.patch.object(torch.distributed, "set_timeout", _set_pg_timeout, create=True)
            )
        yield
