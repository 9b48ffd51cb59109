"""Which torchtitan generation is installed: the one place that asks.

torchtitan 0.3.0 rebuilt its models (``Config``-built modules, ``GQAttention`` with
``qkv_linear`` / ``rope`` / ``inner_attention`` parts, no ``TransformerModelArgs``) and needs
torch 2.13; 0.2.2 runs on torch 2.11 too (the GPU machines this project's evidence script runs
on). Each model family has one module per generation, ``models.tt022`` and ``models.tt030``,
with the same names; ``models.family`` registers the installed generation's, so nothing else
in the package asks which torchtitan it runs on.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType

import torch

try:
    TORCHTITAN_VERSION = version("torchtitan")
except PackageNotFoundError:
    raise ModuleNotFoundError(
        "the model families run on torchtitan, which is not installed: pip install "
        "'torchtitan>=0.2.2,<0.4'",
        name="torchtitan",
    ) from None

_PACKAGES = {(0, 2): "tt022", (0, 3): "tt030"}
"""(major, minor) -> the package of the families on that torchtitan generation."""
_TORCH_NEEDED = {(0, 3): (2, 13)}
"""The oldest torch each generation imports on (measured: 0.3.0 needs torch.distributed.fsdp's
``DataParallelMeshDims``, which torch 2.11 lacks)."""


def _release(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _generation() -> str:
    release = _release(TORCHTITAN_VERSION)
    if release not in _PACKAGES:
        raise ImportError(
            f"torchtitan {TORCHTITAN_VERSION} is installed; upipe-dtensor runs on torchtitan "
            f"0.2.2 or 0.3.0: pip install 'torchtitan>=0.2.2,<0.4'"
        )
    needed = _TORCH_NEEDED.get(release)
    if needed is not None and _release(torch.__version__) < needed:
        raise ImportError(
            f"torchtitan {TORCHTITAN_VERSION} needs torch >= {needed[0]}.{needed[1]}, and torch "
            f"{torch.__version__} is installed: pip install 'torch>={needed[0]}.{needed[1]}', "
            f"or keep this torch with pip install torchtitan==0.2.2"
        )
    return _PACKAGES[release]


GENERATION = _generation()
"""The package of the installed generation's families: ``"tt022"`` or ``"tt030"``."""


def family_module(family: str) -> ModuleType:
    """The installed generation's module of ``family`` (``"llama3"``, ``"qwen3"``)."""
    return importlib.import_module(f"upipe_dtensor.models.{GENERATION}.{family}")


def generation_module() -> ModuleType:
    """The installed generation's package (what its families share: ``RoPEScalingArgs``,
    ``OUTPUT_WEIGHT``)."""
    return importlib.import_module(f"upipe_dtensor.models.{GENERATION}")
