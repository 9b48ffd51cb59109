"""The host store's old import path: the store lives in ``runtime.host_store``, the project's one
device-runtime seam, below the kernels (which send document metadata to the device through its
``to_device``). Kept so the modules and scripts that import it from here keep working."""

from upipe_dtensor.runtime.host_store import (
    HostMemory,
    HostStore,
    Parked,
    is_pinned,
    named_host_store,
    rehearsing,
    to_device,
)

__all__ = [
    "HostMemory",
    "HostStore",
    "Parked",
    "is_pinned",
    "named_host_store",
    "rehearsing",
    "to_device",
]
