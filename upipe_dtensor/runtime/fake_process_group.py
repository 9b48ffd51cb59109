"""The fake process group: every rank of a job laid out in one process, collectives that move no
data. The planner (``planning.step``) runs a job's real step on it with fake tensors.

torch registers the ``"fake"`` backend, and defines the ``FakeStore`` it is initialised with, in
a private test module (``torch.testing._internal.distributed.fake_pg``): importing that module is
what makes ``init_process_group("fake")`` work. This is the package's one import of it, so a
torch release that moves it breaks here, with a message saying so, and not inside a plan.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

PRIVATE_MODULE = "torch.testing._internal.distributed.fake_pg"


def init_fake_process_group(world_size: int) -> None:
    """Initialise the default process group as rank 0 of ``world_size`` fake ranks."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as err:
        raise ImportError(
            f"torch {torch.__version__} has no {PRIVATE_MODULE}.FakeStore, which registers the "
            "fake process group the planner lays its ranks out on; this torch moved it: point "
            "upipe_dtensor/runtime/fake_process_group.py at its new home"
        ) from err
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
