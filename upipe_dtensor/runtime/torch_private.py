"""torch's private names the package uses, in one place: every ``torch._...`` module and every
``_``-prefixed torch name (``torch._C._...``, ``torch.overrides._...``) is imported here and
nowhere else (``tests/test_torch_private.py`` refuses one anywhere else), so a torch release that
moves or changes one breaks this module, at import, and the line beside it says what it was for.

Each name is re-exported under a public spelling (a leading underscore dropped), with what it is
for and who uses it. Every one was checked on torch 2.13, installed on the CPU machines, where the
tests import this module; the GPU machines run torch 2.11. torch's fake process group, which the
plans' fake ranks need, is imported only when a job lays them out (``fake_store``), as before.
"""

from __future__ import annotations

import torch

# dynamo_config, dynamo_reset: patch dynamo's settings, empty its caches (planning.compiled).
# Checked on 2.13; the GPU machines run 2.11.
from torch._dynamo import config as dynamo_config
from torch._dynamo import reset as dynamo_reset

# aot_autograd: the AOTAutograd backend factory the planner's backend is built with
# (planning.compiled). Checked on 2.13; the GPU machines run 2.11.
from torch._dynamo.backends.common import aot_autograd

# The backend registry: COMPILER_FNS (its table) and register_backend, for the planner's backend
# (planning.compiled); list_backends, lookup_backend and InvalidBackend check ``[compile]
# backend`` (config.checks). Checked on 2.13; the GPU machines run 2.11.
from torch._dynamo.backends.registry import _COMPILER_FNS as COMPILER_FNS
from torch._dynamo.backends.registry import list_backends, lookup_backend, register_backend
from torch._dynamo.exc import InvalidBackend

# calculate_time_spent, counters: dynamo's own compile accounting, for the log after the first
# step (train.parallelize). Checked on 2.13; the GPU machines run 2.11.
from torch._dynamo.utils import calculate_time_spent, counters

# detect_fake_mode: the fake mode of a compiled graph's example inputs (planning.compiled).
# Checked on 2.13; the GPU machines run 2.11.
from torch._guards import detect_fake_mode

# recursive_post_grad_passes, partition_fn, select_decomp_table, get_donated_idxs, V: inductor's
# own AOTAutograd set-up, which the planner's backend repeats before it replays a graph
# (planning.compiled). Checked on 2.13; the GPU machines run 2.11.
from torch._inductor.compile_fx import _recursive_post_grad_passes as recursive_post_grad_passes
from torch._inductor.compile_fx import partition_fn
from torch._inductor.decomposition import select_decomp_table

# lowerings, fallbacks, make_fallback, tag_to_layout_constraint: which ops inductor lowers, and
# how a custom op becomes an eager fallback (kernels.inductor, planning.compiled).
# Checked on 2.13; the GPU machines run 2.11.
from torch._inductor.lowering import fallbacks, lowerings, make_fallback, tag_to_layout_constraint
from torch._inductor.utils import get_donated_idxs
from torch._inductor.virtualized import V

# get_layout_constraint_tag: a custom op's layout constraint (kernels.inductor).
# Checked on 2.13; the GPU machines run 2.11.
from torch._library.utils import get_layout_constraint_tag

# is_fake: whether a tensor is a fake tensor (kernels, models.long_context, runtime.host_store,
# planning); FakeTensorMode: the mode a plan's step runs under (planning.step);
# DataDependentOutputException: what a fake tensor raises when the host reads its value
# (planning.rehearsal); unset_fake_temporarily: real tensors for a moment inside a fake step
# (kernels.document_blocks). Checked on 2.13; the GPU machines run 2.11.
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensorMode,
    is_fake,
    unset_fake_temporarily,
)

# checkpoint_wrapper: wrap a block for activation checkpointing or offload (memory.offload);
# CHECKPOINT_PREFIX: the name segment the wrapper adds to parameter names (models.long_context).
# Checked on 2.13; the GPU machines run 2.11.
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX as CHECKPOINT_PREFIX,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

# consolidate_safetensors_files_on_every_rank: merge sharded HF safetensors into whole files
# (checkpointing.weights). Checked on 2.13; the GPU machines run 2.11.
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files_on_every_rank,
)

# resolve_process_group: the process group a functional collective's group name stands for
# (parallel.all_to_all, planning.step_work). Checked on 2.13; the GPU machines run 2.11.
from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group

# _HeadTailLoadBalancer: behind head_tail_indices (below). Checked on 2.13; the GPU machines
# run 2.11.
from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

# is_fx_symbolic_tracing: FX's tracing flag, up while AOT autograd traces (kernels.op_mode).
# Checked on 2.13; the GPU machines run 2.11.
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

# device_constructors: the factory functions that take a ``device`` (planning.rehearsal).
# Checked on 2.13; the GPU machines run 2.11.
from torch.utils._device import _device_constructors as device_constructors

# TorchDispatchMode: the base of the planner's op trackers (planning.tracker, step_work,
# rehearsal); current_dispatch_mode_stack: the dispatch modes on now (planning.compiled);
# is_traceable_wrapper_subclass: a tensor whose memory is its inner tensors' (planning.tracker).
# Checked on 2.13; the GPU machines run 2.11.
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._python_dispatch import (
    _get_current_dispatch_mode_stack as current_dispatch_mode_stack,
)

OpOverload = torch._ops.OpOverload
"""The type of an aten or custom op overload (kernels.op_mode, planning.compiled). Checked on
2.13; the GPU machines run 2.11."""

current_graph_task_id = torch._C._current_graph_task_id
"""-1 outside a backward pass, the running backward's id inside one (memory.kept_attention,
planning.step, planning.rehearsal). Checked on 2.13; the GPU machines run 2.11."""

grouped_mm = torch._grouped_mm
"""The grouped GEMM of a mixture of experts' routed tokens, which torchtitan's experts call too
(memory.grouped_swiglu). Checked on 2.13; the GPU machines run 2.11."""

get_dispatch_mode = torch._C._get_dispatch_mode
TorchDispatchModeKey = torch._C._TorchDispatchModeKey
"""With ``get_dispatch_mode``: whether a fake mode is on (planning.rehearsal). Checked on 2.13;
the GPU machines run 2.11."""

engine_run_backward = torch.autograd.graph._engine_run_backward
"""Start the autograd engine as ``torch.autograd.backward`` does, here with the rehearsal's mode
on (planning.rehearsal). Checked on 2.13; the GPU machines run 2.11."""

is_torch_function_mode_enabled = torch.overrides._is_torch_function_mode_enabled
pop_torch_function_mode = torch.overrides._pop_mode
push_torch_function_mode = torch.overrides._push_mode
"""The torch-function mode stack: the rehearsal takes its mode off around a compiled block and
puts it back (planning.rehearsal). Checked on 2.13; the GPU machines run 2.11."""


def tensor_use_count(tensor: torch.Tensor) -> int:
    """How many C++ references hold ``tensor``'s TensorImpl (its Python object counts one): gloo's
    worker thread lets go of an exchange's buffers after the exchange's ``wait`` returns
    (parallel.all_to_all). Checked on 2.13; the GPU machines run 2.11."""
    return torch.Tensor._use_count(tensor)


def queue_backward_callback(callback) -> None:
    """Run ``callback`` when the running backward pass ends, through the autograd engine's queue
    (planning.depth). Checked on 2.13; the GPU machines run 2.11."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def head_tail_indices(seq_len: int, cp_degree: int) -> torch.Tensor:
    """The token order torch's head-tail load balancer gives ``cp_degree`` ranks (its first row):
    how torchtitan's context parallelism shards a sequence (integrations.torchtitan.common)."""
    return _HeadTailLoadBalancer(seq_len, cp_degree, "cpu")._generate_indices()[0]


FAKE_PG_MODULE = "torch.testing._internal.distributed.fake_pg"
"""Where torch registers the ``"fake"`` process-group backend and defines its ``FakeStore``: a
private test module. Checked on 2.13; the GPU machines run 2.11."""


def fake_store():
    """A ``FakeStore`` for ``init_process_group("fake")``: importing its module is what registers
    the fake backend (runtime.fake_process_group). Imported only when called, so a torch that
    moved it fails here, with a message saying so, and not inside a plan."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as err:
        raise ImportError(
            f"torch {torch.__version__} has no {FAKE_PG_MODULE}.FakeStore, which registers the "
            "fake process group the planner lays its ranks out on; this torch moved it: point "
            "upipe_dtensor/runtime/torch_private.py at its new home"
        ) from err
    return FakeStore()


__all__ = [
    "CHECKPOINT_PREFIX",
    "COMPILER_FNS",
    "FAKE_PG_MODULE",
    "DataDependentOutputException",
    "FakeTensorMode",
    "InvalidBackend",
    "OpOverload",
    "TorchDispatchMode",
    "TorchDispatchModeKey",
    "V",
    "aot_autograd",
    "calculate_time_spent",
    "checkpoint_wrapper",
    "consolidate_safetensors_files_on_every_rank",
    "counters",
    "current_dispatch_mode_stack",
    "current_graph_task_id",
    "detect_fake_mode",
    "device_constructors",
    "dynamo_config",
    "dynamo_reset",
    "engine_run_backward",
    "fake_store",
    "fallbacks",
    "get_dispatch_mode",
    "get_donated_idxs",
    "get_layout_constraint_tag",
    "grouped_mm",
    "head_tail_indices",
    "is_fake",
    "is_fx_symbolic_tracing",
    "is_traceable_wrapper_subclass",
    "is_torch_function_mode_enabled",
    "list_backends",
    "lookup_backend",
    "lowerings",
    "make_fallback",
    "partition_fn",
    "pop_torch_function_mode",
    "push_torch_function_mode",
    "queue_backward_callback",
    "recursive_post_grad_passes",
    "register_backend",
    "resolve_process_group",
    "select_decomp_table",
    "tag_to_layout_constraint",
    "tensor_use_count",
    "unset_fake_temporarily",
]
