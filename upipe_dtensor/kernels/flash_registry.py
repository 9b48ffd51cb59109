"""Torch's flash-attention registry: the backends that run aten's flash ops re-registered with
other kernels (FA3, FA4), and the switch that points those ops at a backend's kernels.

Its own module so the attention calls (``kernels.attention``), the backend probe
(``kernels.probe``) and the backend choice (``kernels.backends``, which runs the probe) import it
in one direction; ``kernels.backends`` re-exports both names.
"""

from __future__ import annotations

REGISTRY_IMPLS = {"fa3": "FA3", "fa4": "FA4"}
"""Backends that run aten's flash ops re-registered through torch's flash-attention registry."""


def activate_backend(backend: str) -> None:
    """Point aten's flash ops at the backend's kernels on this (real) GPU: FA3 or FA4 through
    torch's registry, FlashAttention-2 (torch's default) for every other backend. Process-wide,
    as torch's registry is; called once per job (and per backend by ``gpu_check``)."""
    from torch.nn.attention import (
        activate_flash_attention_impl,
        current_flash_attention_impl,
        restore_flash_attention_impl,
    )

    impl = REGISTRY_IMPLS.get(backend)
    if impl is not None and current_flash_attention_impl() != impl:
        activate_flash_attention_impl(impl)
    elif impl is None and current_flash_attention_impl() is not None:
        restore_flash_attention_impl()
