"""The spawn harness itself: a worker must end cleanly even when gloo's threads outlive
``destroy_process_group`` and still run Python after the test function returned."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks

pytestmark = pytest.mark.distributed

_KEPT: list = []


def _late_python_on_a_gloo_thread(rank: int, world: int) -> None:
    """What FSDP2/DTensor tests do to the harness, made deterministic: torch's caches keep the
    process group (through a DeviceMesh) after ``destroy_process_group``, so its threads live
    on; here a module global keeps it. Rank 0's last collective completes only after rank 1
    joins, 1 s later, and its completion runs Python (a future callback) on a gloo thread:
    after rank 0's test function has returned."""
    _KEPT.append(dist.group.WORLD)
    send = torch.ones(1024)
    recv = torch.empty_like(send)
    if rank == 1:
        time.sleep(1.0)
        dist.all_to_all_single(recv, send)
        return
    work = dist.all_to_all_single(recv, send, async_op=True)
    work.get_future().then(lambda future: future.value())


def test_worker_ends_cleanly_when_gloo_threads_run_python_late() -> None:
    run_on_ranks(2, _late_python_on_a_gloo_thread)  # a rank killed by SIGABRT raises here
