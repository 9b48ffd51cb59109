"""Which attention kernels run: the backends a user chooses, what each needs, and ``auto``.

Backends (``[parallelism] attention_backend``, the styles' ``backend``):
  ``fa3``    FlashAttention-3 (Hopper only), through torch's flash-attention registry:
             ``torch.nn.attention.activate_flash_attention_impl("FA3")`` re-registers aten's flash
             ops with FA3's kernels (the ``flash_attn_interface`` module, built from
             flash-attention's ``hopper/`` folder), so the code calls the same aten ops as
             ``sdpa``, and the traced CUDA branch covers it;
  ``fa4``    FlashAttention-4 (CuTe DSL; Hopper and Blackwell), the same way with "FA4"
             (``pip install 'upipe-dtensor[fa4]'``, the ``flash-attn-4`` package);
  ``cudnn``  aten's cuDNN attention (ships in torch; no document masks);
  ``flash``  the flash-attn package (FlashAttention-2, >= 2.7);
  ``sdpa``   PyTorch's own kernels: aten's flash kernel (FlashAttention-2) in 16 bits, the
             memory-efficient kernel in float32, the CPU kernel on CPU;
  ``auto``   on CUDA the fastest of these that runs the job here, by the published order for the
             GPU's architecture (``AUTO_ORDER``); on CPU ``sdpa``.

The published order, H100, bf16, head_dim 128, causal, 16K tokens (FA3 paper, arXiv 2407.08608,
Figs. 5-6, TFLOP/s forward / backward): FA3 616 / 561, cuDNN 539 / 516, FlashAttention-2 335 /
322. FA4's paper is about Blackwell (B200), where it leads cuDNN; no Hopper figure is published,
so on Hopper it comes after cuDNN.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from dataclasses import dataclass

import torch
from torch import Tensor

from upipe_dtensor.kernels import probe
from upipe_dtensor.kernels.flash_registry import REGISTRY_IMPLS
from upipe_dtensor.kernels.flash_registry import activate_backend as activate_backend  # re-export
from upipe_dtensor.runtime.torch_private import is_fake

BACKENDS = ("auto", "fa3", "fa4", "cudnn", "flash", "sdpa")
"""What a user chooses (``[parallelism] attention_backend``)."""
CUDA_BACKENDS = ("fa3", "fa4", "cudnn", "flash")
"""Backends with no CPU kernel."""
FLASH_ATTN_VERSIONS = ("2.7.0", "2.8.3")
"""flash-attn releases this code is written for: from 2.7.0 (the 11-argument
``_flash_attn_forward`` returning 4 values) up to 2.8.3, the newest checked against our calls."""

KERNEL_LIMITS = {
    # backend: (head_dim multiple, largest head_dim, dtypes); sources: flash-attn's and aten's
    # flash_api.cpp (mha_fwd: head_size % 8 == 0, <= 256, "only support fp16 and bf16"),
    # flash-attention's hopper/flash_api.cpp for FA3 (the same limits), flash_attn/cute/interface.py
    # for FA4 (bf16/fp16; head_dim 64, 96, 128 on Hopper), aten's sdp_utils.cpp for cuDNN
    # (head_dim % 8 == 0, <= 128) and the memory-efficient kernel (head_dim % 8 == 0 for 16-bit
    # inputs, % 4 for float32; any dtype of the three).
    "fa3": (8, 256, (torch.bfloat16, torch.float16)),
    "fa4": (8, 128, (torch.bfloat16, torch.float16)),
    "flash": (8, 256, (torch.bfloat16, torch.float16)),
    "cudnn": (8, 128, (torch.bfloat16, torch.float16)),
    "sdpa": (8, 256, (torch.bfloat16, torch.float16, torch.float32)),
}

AUTO_ORDER = {
    9: ("fa3", "cudnn", "fa4", "flash", "sdpa"),  # Hopper: the published H100 order
    10: ("fa4", "cudnn", "flash", "sdpa"),  # Blackwell: FA3 does not run there
}
"""``auto``'s order per compute-capability major; other GPUs (Ampere, Ada) take flash, sdpa."""
OTHER_GPUS_ORDER = ("flash", "sdpa")
PLANNED_CAPABILITY = 9
"""The architecture a traced plan assumes (the planner's GPU profiles are Hopper's)."""
PROBE_HEAD_DIM = 128
"""head_dim of the probe when the caller knows no model (Llama3's)."""


@dataclass(frozen=True)
class Choice:
    """The backend that runs, and why each faster one in ``auto``'s order was skipped."""

    backend: str
    skipped: dict[str, str]

    def describe(self) -> str:
        """For the start-up line: "fa3" or "cudnn (auto; skipped fa3: ...)"."""
        if not self.skipped:
            return self.backend
        reasons = "; ".join(f"{name}: {why}" for name, why in self.skipped.items())
        return f"{self.backend} (auto; skipped {reasons})"


@functools.cache
def flash_attn_problem() -> str | None:
    """Why the flash-attn package cannot run here, or None when it can. The compiled module is
    imported (``flash_attn_interface`` imports ``flash_attn_2_cuda``): a wheel built for another
    torch passes ``find_spec`` and fails only there."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        version = importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        return "flash-attn is not installed (pip install 'upipe-dtensor[flash]')"
    if _version_tuple(version) < _version_tuple(FLASH_ATTN_VERSIONS[0]):
        return f"flash-attn {version} is older than {FLASH_ATTN_VERSIONS[0]}; upgrade it"
    try:
        importlib.import_module("flash_attn.flash_attn_interface")
    except Exception as err:  # an ABI mismatch surfaces as ImportError or OSError
        return (
            f"flash-attn {version} does not import ({type(err).__name__}: {err}); it was built "
            f"for another torch than {torch.__version__}: reinstall it from source "
            "(pip install flash-attn --no-build-isolation)"
        )
    return None


_REGISTRY_MODULES = {
    # impl: (module torch's registry imports, its distribution (None: built from source),
    #        compute-capability majors, how to install)
    "FA3": (
        "flash_attn_interface",
        None,
        (9,),
        "build it from flash-attention's hopper/ folder (python setup.py install)",
    ),
    "FA4": (
        "flash_attn.cute.interface",
        "flash-attn-4",
        (9, 10),
        "pip install 'upipe-dtensor[fa4]' in an environment without the [flash] extra (flash-attn "
        "2.8.3 ships an older flash_attn/cute in the same folder)",
    ),
}


@functools.cache
def registry_impl_problem(impl: str) -> str | None:
    """Why torch's registry cannot activate ``impl`` ("FA3", "FA4") here, or None. FA4 must be
    the ``flash-attn-4`` distribution: flash-attn 2.8.3's wheel also installs a
    ``flash_attn/cute/interface.py``, an older one whose functions torch's FA4 wrapper cannot
    call, and it imports just as well."""
    module, distribution, majors, install = _REGISTRY_MODULES[impl]
    if not torch.cuda.is_available():
        return "no CUDA device"
    major = torch.cuda.get_device_capability()[0]
    if major not in majors:
        return f"{impl} runs on compute capability {' or '.join(map(str, majors))}.x, not {major}.x"
    if distribution is not None:
        try:
            importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return f"the {distribution} package is not installed; {install}"
    try:
        importlib.import_module(module)
    except Exception as err:
        return f"{module} does not import ({type(err).__name__}: {err}); {install}"
    return None


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:3] if part.isdigit())


def kernel_limit_problem(backend: str, head_dim: int | None, dtype: torch.dtype | None) -> str:
    """Why ``backend`` cannot run this head_dim or dtype ("" when it can, or is not checked)."""
    if backend not in KERNEL_LIMITS:
        return ""
    multiple, largest, dtypes = KERNEL_LIMITS[backend]
    if head_dim is not None and (head_dim % multiple or head_dim > largest):
        return f"head_dim {head_dim} is not a multiple of {multiple} up to {largest}"
    if dtype is not None and dtype not in dtypes:
        return f"no {str(dtype).removeprefix('torch.')} kernel"
    return ""


def _install_problem(name: str) -> str | None:
    """Why ``name`` is not usable on this machine's GPU (package, architecture), or None."""
    if name == "flash":
        return flash_attn_problem()
    if name in REGISTRY_IMPLS:
        return registry_impl_problem(REGISTRY_IMPLS[name])
    return None if torch.cuda.is_available() else "no CUDA device"


def probe_problem(name: str, head_dim: int, dtype: torch.dtype, documents: bool) -> str:
    """Why ``name`` fails a tiny forward and backward on this GPU ("" when it runs right):
    ``kernels.probe``, whose first call per shape takes milliseconds."""
    return probe.probe_problem(name, head_dim, dtype, documents)


def _runtime_problem(
    name: str, head_dim: int | None, dtype: torch.dtype | None, documents: bool
) -> str:
    """Why ``name`` cannot run on this machine's GPU: not installed, or failing the probe."""
    return _install_problem(name) or probe_problem(
        name, head_dim or PROBE_HEAD_DIM, dtype or torch.bfloat16, documents
    )


def choose_backend(
    name: str,
    device_type: str,
    *,
    traced: bool = False,
    documents: bool = False,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
) -> Choice:
    """The backend that runs ``name`` on a ``device_type`` device, for a job with ``documents``
    masks, ``head_dim`` and compute ``dtype`` (None: not checked). ``traced``: planning a GPU run
    on fake tensors, where every kernel is traced through aten's ops and nothing needs to be
    installed; ``auto`` then plans a Hopper GPU with its fastest kernel (``PLANNED_CAPABILITY``).
    On a real GPU a backend is accepted once it is installed for this torch and architecture
    and passes a tiny forward and backward with the job's head_dim, dtype and masks
    (``kernels.probe``). ValueError when a named CUDA backend cannot run here, or (``head_dim``
    given) when the backend that would run cannot run this head_dim and dtype
    (``check_kernel_limits``)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    if device_type != "cuda":
        if name in CUDA_BACKENDS:
            raise ValueError(
                f"attention backend {name!r} needs a CUDA device; on {device_type} use 'sdpa' or "
                "'auto'"
            )
        return Choice("sdpa", {})
    if name != "auto":
        if head_dim is not None:
            check_kernel_limits(name, head_dim, dtype)
        problem = None if traced else _runtime_problem(name, head_dim, dtype, documents)
        if problem:
            raise ValueError(f"attention backend {name!r}: {problem}; or use 'auto' or 'sdpa'")
        return Choice(name, {})
    major = PLANNED_CAPABILITY if traced else torch.cuda.get_device_capability()[0]
    skipped: dict[str, str] = {}
    for candidate in AUTO_ORDER.get(major, OTHER_GPUS_ORDER):
        problem = kernel_limit_problem(candidate, head_dim, dtype)
        if not problem and documents and candidate == "cudnn":
            problem = "no document masks"
        if not problem and not traced:
            problem = _runtime_problem(candidate, head_dim, dtype, documents)
        if not problem:
            return Choice(candidate, skipped)
        skipped[candidate] = problem
    if head_dim is not None:  # not even sdpa runs it: say which kernels could
        check_kernel_limits("sdpa", head_dim, dtype)
    if "sdpa" in skipped:  # torch's own kernels fail here: nothing is left to fall back on
        raise ValueError(f"no attention kernel runs here: {Choice('', skipped).describe()}")
    return Choice("sdpa", skipped)


def resolve_backend(name: str, device_type: str, *, traced: bool = False) -> str:
    """``choose_backend``'s backend, for callers that know nothing of the job's shapes."""
    return choose_backend(name, device_type, traced=traced).backend


def check_kernel_limits(backend: str, head_dim: int, dtype: torch.dtype | None = None) -> None:
    """ValueError when a CUDA backend cannot run this head_dim (or dtype), naming the backends
    that can; called when a style is applied, before any forward."""
    problem = kernel_limit_problem(backend, head_dim, dtype)
    if not problem:
        return
    working = [name for name in KERNEL_LIMITS if not kernel_limit_problem(name, head_dim, dtype)]
    multiple, largest, dtypes = KERNEL_LIMITS[backend]
    names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    raise ValueError(
        f"attention backend {backend!r} runs head_dim a multiple of {multiple} up to {largest} "
        f"in {names}; this model has head_dim {head_dim}"
        + (f" in {str(dtype).removeprefix('torch.')}" if dtype is not None else "")
        + (f": use {' or '.join(map(repr, working))}" if working else ": no CUDA kernel runs it")
    )


def op_kernel(backend: str, kernel_device: str, x: Tensor, *, documents: bool = False) -> str:
    """The kernel an attention op runs for its input ``x`` (with ``documents`` masks or not):
    ``backend`` resolved for the device the job runs on (``kernel_device``; "" means ``x``'s
    own): "cpu", or on CUDA the backend itself. Fake ``x`` (planning) traces the CUDA branch."""
    device_type = kernel_device or x.device.type
    if device_type != "cuda":
        choose_backend(backend, device_type)  # a CUDA backend on CPU is refused
        return "cpu"
    return choose_backend(
        backend, device_type, traced=is_fake(x), documents=documents, dtype=x.dtype
    ).backend
