"""What one training step asks of a rank's hardware, counted from the traced step itself.

A ``TorchDispatchMode`` beside the memory tracker sees every aten op of the planner's fake step
(the custom ops run transparently) and counts:

- matmul FLOPs with torch's own formulas (``torch.utils.flop_counter``'s registry, the one
  ``FlopCounterMode`` uses), recompute included, since the recompute runs in the trace;
- attention FLOPs from each kernel call's block geometry: ``FlopCounterMode`` counts aten's flash
  and cuDNN ops as the full square whatever ``is_causal`` says, and does not see which blocks a
  ring or FPDT skips; here a causal block counts its visible (query, key) pairs, as the kernels
  compute them (a varlen call, documents, counts every document as long as the longest: an upper
  bound; the planner's fake document ids plan dense blocks anyway);
- the bytes every other device op reads and writes (elementwise work, reductions, copies), which
  are memory-bound;
- bytes per collective, by kind and by whether its group spans nodes, from the op's own process
  group (all-to-all: what this rank sends; all-gather and reduce-scatter: the bus bytes of NCCL's
  busbw convention; point-to-point: the tensor), every collective in either form torch
  dispatches it (``_COLLECTIVES``); a step with one it has no rule for is refused, not priced;
- host <-> device copies, split into the activation offload's and the rest (FPDT's chunks).

In a compiled block (``planning.compiled``) the ops inductor fuses are counted as its kernels:
one launch each, reading its inputs and writing its stored outputs once (``fused_kernels``,
``fused_bytes``), instead of one op and its bytes per aten op.

Loops the planner shortens on fake tensors (``kernels.tiling.visited``) are counted whole: each
visited iteration's counts are multiplied by the real iterations it stands for. The optimizer
step is not counted op by op: an offloaded optimizer runs on the host, so the
model charges it per parameter (``StepTimeModel``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.flop_counter import flop_registry

from upipe_dtensor.config import ConfigError
from upipe_dtensor.modes.loops import repeats
from upipe_dtensor.planning.tracker import (
    EXPERTS,
    OFFLOAD,
    is_untracked,
    label_from_stack,
    run_op_bodies,
    tensor_leaves,
)
from upipe_dtensor.runtime.torch_private import TorchDispatchMode, resolve_process_group

aten = torch.ops.aten
_MATMULS = {
    aten.mm: aten.mm,
    aten.addmm: aten.addmm,
    aten.bmm: aten.bmm,
    aten.baddbmm: aten.baddbmm,
}
_MATMULS.update({aten.addmm_: aten.addmm, aten.baddbmm_: aten.baddbmm})
"""Matmul ops -> the op whose formula counts them (torch's registry has no in-place variants)."""


def grouped_mm_flops(a: torch.Tensor, out: torch.Tensor) -> float:
    """A grouped GEMM's FLOPs (torch's registry has no formula): each output element sums
    ``a``'s last dimension, (R, K) x (E, K, N) -> (R, N); in the weight-gradient form,
    (M, R) x (R, N) -> (E, M, N), each of M x N sums over the expert's rows only, R in all."""
    if out.dim() == 3 and a.dim() == 2:
        return 2.0 * a.shape[0] * a.shape[1] * out.shape[-1]
    return 2.0 * out.numel() * a.shape[-1]


# overload packet -> (kernel family, query argument, is_causal argument, query layout, backward)
_ATTENTION = {
    aten._flash_attention_forward: ("flash", 0, 8, "bshd", False),
    aten._flash_attention_backward: ("flash", 1, 11, "bshd", True),
    aten._scaled_dot_product_cudnn_attention: ("cudnn", 0, 6, "bhsd", False),
    aten._scaled_dot_product_cudnn_attention_backward: ("cudnn", 1, 14, "bhsd", True),
    aten._scaled_dot_product_efficient_attention: ("efficient", 0, 6, "bhsd", False),
    aten._scaled_dot_product_efficient_attention_backward: ("efficient", 1, 11, "bhsd", True),
    aten._scaled_dot_product_flash_attention_for_cpu: ("cpu", 0, 4, "bhsd", False),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: ("cpu", 1, 7, "bhsd", True),
}
"""aten's attention ops. The "flash" family is whatever aten's flash ops run: FlashAttention-2,
or FA3 / FA4 once torch's registry points them there (``kernels.backends``)."""
_FREE = {
    # no bytes move: views, metadata, allocation, scalars
    "view", "_unsafe_view", "t", "transpose", "detach", "alias", "slice", "select", "expand",
    "unsqueeze", "squeeze", "permute", "as_strided", "split", "split_with_sizes", "unbind",
    "chunk", "narrow", "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
    "_local_scalar_dense", "lift_fresh", "resize_", "set_", "unflatten", "flatten", "reshape",
    "_reshape_alias", "view_as", "diagonal", "sym_size", "sym_stride", "sym_numel", "is_same_size",
    "promote_types", "device", "_has_compatible_shallow_copy_type", "record_stream",
}  # fmt: skip
_SHARES = {
    "others": lambda nbytes, size: nbytes * (size - 1) / size,  # all but this rank's own part
    "gathered": lambda nbytes, size: nbytes * (size - 1),  # a functional all-gather's input
    "both ways": lambda nbytes, size: 2 * nbytes * (size - 1) / size,  # all-reduce bus bytes
    "whole": lambda nbytes, size: nbytes,
    "none": lambda nbytes, size: 0.0,  # a barrier: a call, no bytes
}
"""How a collective's bytes follow from its counted tensors and its group size (NCCL's busbw
convention for all-gather, reduce-scatter and all-reduce; what this rank sends otherwise)."""
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
_COLLECTIVES: dict[tuple[str, str], tuple[str, int, str] | None] = {
    # (namespace, op) -> (kind, argument holding the counted tensors, share); None: no traffic
    # of its own (a receive, whose bytes are the sender's send; a wait; a check)
    ("c10d", "alltoall_base_"): ("all_to_all", 1, "others"),
    ("c10d", "alltoall_"): ("all_to_all", 1, "others"),
    ("c10d", "_allgather_base_"): ("all_gather", 0, "others"),
    ("c10d", "allgather_"): ("all_gather", 0, "others"),
    ("c10d", "allgather_coalesced_"): ("all_gather", 0, "others"),
    ("c10d", "allgather_into_tensor_coalesced_"): ("all_gather", 0, "others"),
    ("c10d", "_reduce_scatter_base_"): ("reduce_scatter", 1, "others"),
    ("c10d", "reduce_scatter_"): ("reduce_scatter", 1, "others"),
    ("c10d", "reduce_scatter_tensor_coalesced_"): ("reduce_scatter", 1, "others"),
    ("c10d", "allreduce_"): ("all_reduce", 0, "both ways"),
    ("c10d", "allreduce_coalesced_"): ("all_reduce", 0, "both ways"),
    ("c10d", "send"): ("p2p", 0, "whole"),
    ("c10d", "recv_"): None,
    ("c10d", "recv_any_source_"): None,
    ("c10d", "broadcast_"): ("other", 0, "whole"),
    ("c10d", "reduce_"): ("other", 0, "whole"),
    ("c10d", "gather_"): ("other", 1, "whole"),
    ("c10d", "scatter_"): ("other", 1, "others"),
    ("c10d", "barrier"): ("other", 0, "none"),
    ("c10d", "monitored_barrier_"): ("other", 0, "none"),
    ("c10d", "check_for_nan"): None,
    ("_c10d_functional", "all_to_all_single"): ("all_to_all", 0, "others"),
    ("_c10d_functional", "all_gather_into_tensor"): ("all_gather", 0, "gathered"),
    ("_c10d_functional", "all_gather_into_tensor_out"): ("all_gather", 0, "gathered"),
    ("_c10d_functional", "all_gather_into_tensor_coalesced"): ("all_gather", 0, "gathered"),
    ("_c10d_functional", "reduce_scatter_tensor"): ("reduce_scatter", 0, "others"),
    ("_c10d_functional", "reduce_scatter_tensor_out"): ("reduce_scatter", 0, "others"),
    ("_c10d_functional", "reduce_scatter_tensor_coalesced"): ("reduce_scatter", 0, "others"),
    ("_c10d_functional", "all_reduce"): ("all_reduce", 0, "both ways"),
    ("_c10d_functional", "all_reduce_"): ("all_reduce", 0, "both ways"),
    ("_c10d_functional", "all_reduce_coalesced"): ("all_reduce", 0, "both ways"),
    ("_c10d_functional", "all_reduce_coalesced_"): ("all_reduce", 0, "both ways"),
    ("_c10d_functional", "broadcast"): ("other", 0, "whole"),
    ("_c10d_functional", "broadcast_"): ("other", 0, "whole"),
    ("_c10d_functional", "isend"): ("p2p", 0, "whole"),
    ("_c10d_functional", "irecv"): None,
    ("_c10d_functional", "wait_tensor"): None,
    ("_c10d_functional", "_wrap_tensor_autograd"): None,
}
"""Every collective the time model prices, in either form torch dispatches it (c10d's eager ops,
the functional ops of DTensor and compiled graphs); a step running another one is refused
(``StepWorkCounter.refuse_unpriced``), never priced without it. "other" (broadcast, reduce,
gather, scatter, barriers) is waited for whole, as an all-reduce is."""


def add_counts(mine: dict, theirs: dict, times: float = 1.0) -> dict:
    """A new dict of counts: ``mine`` plus ``times`` x ``theirs``, key by key."""
    out = dict(mine)
    for key, value in theirs.items():
        out[key] = out.get(key, 0.0) + times * value
    return out


@dataclass
class Traffic:
    """Bytes on the wire and calls of one kind of communication."""

    bytes: float = 0.0
    calls: float = 0.0


@dataclass
class StepWork:
    """One rank's counted work for one training step (module docstring)."""

    matmul_flops: float = 0.0
    ops: float = 0.0
    """Ops that do work (not views): each costs a fixed dispatch overhead where the host cannot
    run ahead of the device (``HardwareProfile.op_overhead_s``, measured on CPU)."""
    attention_flops: dict[tuple[str, str], float] = field(default_factory=dict)
    """(kernel family: "flash" | "cudnn" | "efficient" | "cpu", "forward causal" |
    "forward full" | "backward") -> FLOPs."""
    memory_bytes: float = 0.0
    communication: dict[tuple[str, bool], Traffic] = field(default_factory=dict)
    """(kind, crosses nodes) -> traffic; kind: all_to_all, all_gather, reduce_scatter,
    all_reduce, p2p (sends only: each hop's receive is the neighbour's send), other."""
    host_bytes: dict[tuple[str, str], float] = field(default_factory=dict)
    """(what: "activation offload" | "other", "to host" | "to device") -> bytes."""
    fused_kernels: float = 0.0
    """Kernels of compiled blocks that fuse elementwise ops and reductions (part of ``ops``)."""
    fused_bytes: float = 0.0
    """The bytes those kernels read and write (part of ``memory_bytes``)."""

    def plus(self, other: StepWork, times: float = 1.0) -> StepWork:
        """A new count: this one plus ``times`` x ``other`` (``times`` -1: the difference)."""
        communication = {key: Traffic(t.bytes, t.calls) for key, t in self.communication.items()}
        for key, traffic in other.communication.items():
            mine = communication.setdefault(key, Traffic())
            mine.bytes += times * traffic.bytes
            mine.calls += times * traffic.calls
        return StepWork(
            matmul_flops=self.matmul_flops + times * other.matmul_flops,
            ops=self.ops + times * other.ops,
            attention_flops=add_counts(self.attention_flops, other.attention_flops, times),
            memory_bytes=self.memory_bytes + times * other.memory_bytes,
            communication=communication,
            host_bytes=add_counts(self.host_bytes, other.host_bytes, times),
            fused_kernels=self.fused_kernels + times * other.fused_kernels,
            fused_bytes=self.fused_bytes + times * other.fused_bytes,
        )

    def to_json(self) -> dict:
        """Plain JSON (tuple keys joined by "|"), for benchmarks that price saved work again."""
        return {
            "matmul_flops": self.matmul_flops,
            "ops": self.ops,
            "memory_bytes": self.memory_bytes,
            "attention_flops": {"|".join(k): v for k, v in self.attention_flops.items()},
            "communication": {
                f"{kind}|{int(crosses)}": [t.bytes, t.calls]
                for (kind, crosses), t in self.communication.items()
            },
            "host_bytes": {"|".join(k): v for k, v in self.host_bytes.items()},
            "fused_kernels": self.fused_kernels,
            "fused_bytes": self.fused_bytes,
        }

    @classmethod
    def from_json(cls, data: dict) -> StepWork:
        communication = {}
        for key, (nbytes, calls) in data["communication"].items():
            kind, crosses = key.split("|")
            communication[(kind, bool(int(crosses)))] = Traffic(nbytes, calls)
        return cls(
            matmul_flops=data["matmul_flops"],
            ops=data.get("ops", 0),
            memory_bytes=data["memory_bytes"],
            attention_flops={tuple(k.split("|")): v for k, v in data["attention_flops"].items()},
            communication=communication,
            host_bytes={tuple(k.split("|")): v for k, v in data["host_bytes"].items()},
            fused_kernels=data.get("fused_kernels", 0.0),
            fused_bytes=data.get("fused_bytes", 0.0),
        )

    def summary(self) -> dict[str, float]:
        """The counts with readable keys (the plan's JSON): FLOPs, bytes, calls."""
        out = {
            "matmul FLOPs": self.matmul_flops,
            "memory-bound bytes": self.memory_bytes,
            "ops": self.ops,
        }
        if self.fused_kernels:
            out["fused kernels (compiled)"] = self.fused_kernels
            out["fused kernel bytes (compiled)"] = self.fused_bytes
        for (family, direction), flops in sorted(self.attention_flops.items()):
            out[f"attention FLOPs, {family} {direction}"] = flops
        for (kind, crosses), traffic in sorted(self.communication.items()):
            where = "across nodes" if crosses else "inside a node"
            out[f"{kind} bytes, {where}"] = traffic.bytes
            out[f"{kind} calls, {where}"] = traffic.calls
        for (what, direction), nbytes in sorted(self.host_bytes.items()):
            out[f"host copies {direction}, {what}"] = nbytes
        return out


def refuse_unpriced(unpriced: set[str]) -> None:
    """ConfigError naming collectives a step ran (``StepWorkCounter.unpriced``) that the time
    model cannot price: a prediction without them would look plausible and be wrong."""
    if unpriced:
        raise ConfigError(
            f"the step runs {', '.join(sorted(unpriced))}, a collective the step-time "
            "model does not price; give it a rule in _COLLECTIVES "
            "(upipe_dtensor/planning/step_work.py) before planning this job's speed"
        )


def _numel_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def visible_pairs(seq_q: int, seq_k: int, causal: bool) -> int:
    """(query, key) pairs a kernel computes: all of them, or with a causal mask aligned to the
    bottom right (flash-attn >= 2.1, aten), key j visible to query i iff j <= i + seq_k - seq_q."""
    if not causal:
        return seq_q * seq_k
    first = seq_k - seq_q + 1  # keys visible to the first query (may be <= 0)
    full_from = max(0, 1 - first)  # queries before this one see nothing
    rows = seq_q - full_from
    if rows <= 0:
        return 0
    start = first + full_from
    capped = max(0, min(rows, seq_k - start + 1))  # rows below the cap grow by one key each
    grow = capped * start + capped * (capped - 1) // 2
    return grow + (rows - capped) * seq_k


def _argument(func, args: tuple, kwargs: dict, index: int):
    """Argument ``index`` of an op call; dispatch leaves out trailing ones left at their
    defaults, so those come from the op's schema."""
    if index < len(args):
        return args[index]
    schema = func._schema.arguments[index]
    return kwargs.get(schema.name, schema.default_value)


def attention_flops(func, args, kwargs=None) -> tuple[str, str, float] | None:
    """(kernel family, "forward causal" | "forward full" | "backward", FLOPs) of an attention
    kernel call, or None for any other op."""
    spec = _ATTENTION.get(func.overloadpacket)
    if spec is None:
        return None
    family, q_index, causal_index, layout, backward = spec
    kwargs = kwargs or {}
    q, k = args[q_index], args[q_index + 1]
    causal = bool(_argument(func, args, kwargs, causal_index))
    if q.dim() == 3:  # varlen (total tokens, heads, d): every document as long as the longest
        max_q = _argument(func, args, kwargs, q_index + (7 if backward else 5))
        tokens, heads, head_dim = q.shape
        pairs = visible_pairs(int(max_q), int(max_q), causal) * tokens // max(int(max_q), 1)
        batch = 1
    else:
        if layout == "bshd":
            batch, seq_q, heads, head_dim = q.shape
            seq_k = k.shape[1]
        else:
            batch, heads, seq_q, head_dim = q.shape
            seq_k = k.shape[2]
        pairs = visible_pairs(seq_q, seq_k, causal)
    forward = 4.0 * batch * heads * head_dim * pairs
    if backward:
        return family, "backward", 2.5 * forward
    return family, ("forward causal" if causal else "forward full"), forward


def _group_of(func, args) -> dist.ProcessGroup | None:
    if func.namespace == "_c10d_functional":  # the group's name, the last positional argument
        return resolve_process_group(args[-1])
    for arg in args:
        if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
            return dist.ProcessGroup.unbox(arg)
    return None


TENSOR_PARALLEL_KINDS = ("tp all_gather", "tp reduce_scatter", "tp all_reduce")
"""The kinds of the collectives a tensor-parallel group runs (``StepWork.communication``): priced
apart from FSDP's, which overlap compute (``step_time``)."""
EXPERT_PARALLEL_KINDS = ("ep all_to_all",)
"""The kind of an expert-parallel group's exchanges: priced apart from the heads' all-to-alls,
which UPipe overlaps with attention (``step_time``)."""


class StepWorkCounter(TorchDispatchMode):
    """Counts a ``StepWork`` while ``counting`` (the measured step, not the optimizer; see the
    module docstring). ``gpus_per_node`` decides which groups cross nodes (ranks numbered node
    by node, as torchrun numbers them); a collective on ``tensor_parallel_group`` (its name) is
    counted as tensor parallelism's (``TENSOR_PARALLEL_KINDS``), an all-to-all an MoE block runs
    as expert parallelism's (``EXPERT_PARALLEL_KINDS``; by its caller, since its group may be
    the very group of the heads' exchanges: a mesh reuses the group of the same ranks)."""

    def __init__(
        self,
        device: torch.device,
        host: torch.device,
        gpus_per_node: int,
        tensor_parallel_group: str = "",
    ) -> None:
        super().__init__()
        self.device, self.host, self.gpus_per_node = str(device), str(host), gpus_per_node
        self.tensor_parallel_group = tensor_parallel_group
        self.work = StepWork()
        self.counting = False
        self.unpriced: set[str] = set()
        """Collectives the step ran that ``_COLLECTIVES`` has no rule for."""
        self._crosses: dict[str, bool] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while ``torch.compile`` compiles, on while its graphs run (``tracker``)."""
        return True

    def __enter__(self):
        run_op_bodies(StepWorkCounter)
        return super().__enter__()

    def count_fused_kernel(self, nbytes: int) -> None:
        """One launch of a compiled block's fused kernel that reads and writes ``nbytes``."""
        if not self.counting:
            return
        weight = repeats()
        self.work.ops += weight
        self.work.fused_kernels += weight
        self.work.memory_bytes += nbytes * weight
        self.work.fused_bytes += nbytes * weight

    def _crosses_nodes(self, group: dist.ProcessGroup) -> bool:
        name = group.group_name
        if name not in self._crosses:
            ranks = dist.get_process_group_ranks(group)
            self._crosses[name] = len({rank // self.gpus_per_node for rank in ranks}) > 1
        return self._crosses[name]

    def refuse_unpriced(self) -> None:
        """ConfigError naming the collectives the step ran that the time model cannot price:
        a prediction without them would look plausible and be wrong."""
        refuse_unpriced(self.unpriced)

    def _count_collective(self, func, args) -> None:
        name = func.overloadpacket.__name__
        if (func.namespace, name) not in _COLLECTIVES:
            self.unpriced.add(f"{func.namespace}::{name}")
            return
        rule = _COLLECTIVES[(func.namespace, name)]
        if rule is None:
            return
        kind, argument, share = rule
        group = _group_of(func, args)
        size = group.size() if group is not None else 1
        counted = tensor_leaves(args[argument])
        nbytes = _SHARES[share](sum(_numel_bytes(t) for t in counted), size)
        if group is not None and group.group_name == self.tensor_parallel_group:
            kind = f"tp {kind}"
        elif kind == "all_to_all" and label_from_stack() == EXPERTS:
            kind = EXPERT_PARALLEL_KINDS[0]
        key = (kind, group is not None and self._crosses_nodes(group))
        traffic = self.work.communication.setdefault(key, Traffic())
        traffic.bytes += nbytes * repeats()
        traffic.calls += repeats()

    def _count_copy(self, func, args, out) -> bool:
        """A copy between device and host memory: counted as host traffic (True), else False."""
        name = func.overloadpacket.__name__
        if name not in ("_to_copy", "copy_", "copy"):
            return False
        source = args[1] if name == "copy_" else args[0]
        target = args[0] if name == "copy_" else out
        devices = (str(source.device), str(target.device))
        if self.host == self.device or set(devices) != {self.device, self.host}:
            return False
        direction = "to host" if devices[1] == self.host else "to device"
        what = "activation offload" if label_from_stack() == OFFLOAD else "other"
        key = (what, direction)
        moved = _numel_bytes(source) * repeats()
        self.work.host_bytes[key] = self.work.host_bytes.get(key, 0.0) + moved
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        name = packet.__name__
        if (
            not self.counting
            or is_untracked()
            or name in _FREE
            or func.namespace in ("prim", "profiler")
        ):
            return out
        weight = repeats()
        work = self.work
        work.ops += weight
        if packet in _MATMULS:
            flops = flop_registry[_MATMULS[packet]](*args, **(kwargs or {}), out_val=out)
            work.matmul_flops += flops * weight
            return out
        if packet is aten._grouped_mm:
            work.matmul_flops += grouped_mm_flops(args[0], out) * weight
            return out
        attention = attention_flops(func, args, kwargs)
        if attention is not None:
            family, direction, flops = attention
            key = (family, direction)
            work.attention_flops[key] = work.attention_flops.get(key, 0.0) + flops * weight
            return out
        if func.namespace in _COLLECTIVE_NAMESPACES:
            self._count_collective(func, args)
            return out
        if self._count_copy(func, args, out):
            return out
        touched = [
            leaf for leaf in tensor_leaves((args, kwargs, out)) if str(leaf.device) == self.device
        ]
        work.memory_bytes += sum(_numel_bytes(t) for t in touched) * weight
        return out
