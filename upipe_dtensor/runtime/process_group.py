"""The process-group backend a job initialises: one backend per device type its collectives use.

NCCL runs collectives on CUDA tensors only. A CUDA job whose collectives also meet host tensors
(FSDP2 CPU offload keeps the sharded parameters, gradients and optimizer state on the host, so
the gradient-norm all-reduce of ``clip_grad_norm_`` and the re-sharding of Hugging Face loads and
exports run on CPU tensors) needs a CPU backend beside it: ``"cuda:nccl,cpu:gloo"``, as
torchtitan's ``init_distributed`` sets up in the same case. With NCCL alone such a collective
raises "No backend type associated with device type cpu" at the first step.

Several ranks on one GPU (``gpu_check``'s numerics on a machine with fewer GPUs than ranks) cannot
use NCCL, which refuses two ranks on one device ("Duplicate GPU detected"): they run gloo
(``runtime.group_backends`` says what gloo does with CUDA tensors).

The trainer (``train.build``), ``gpu_check`` and the planner all take the string from
``process_group_backend`` (whether a job holds host tensors is the job's question:
``train.setup.holds_host_tensors``); the planner checks every collective of the traced step
against it (``planning.rehearsal``, ``group_backends.backend_device_types``), so a host
collective without a CPU backend is refused in the plan.
"""

from __future__ import annotations


def process_group_backend(device_type: str, host_tensors: bool, shared_gpu: bool = False) -> str:
    """The ``init_process_group`` backend of a job on ``device_type`` devices: gloo on CPU;
    NCCL on CUDA, with gloo for CPU tensors when the job holds ``host_tensors``; gloo on CUDA
    too when ranks share a GPU (``shared_gpu``: NCCL refuses that)."""
    if device_type != "cuda" or shared_gpu:
        return "gloo"
    return "cuda:nccl,cpu:gloo" if host_tensors else "nccl"
