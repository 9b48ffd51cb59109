"""What every Ulysses-family loop does with head stages, whatever makes its Q, K and V: pick a
stage's heads, exchange them between the sequence and head layouts, write results back.

``HeadStages`` holds the per-call constants of one attention layer for a span of the local
sequence (the whole shard for UPipe, Ulysses and the ring; one sequence chunk for FPDT): the head
schedule, the head axis's process group, the shapes. A subclass says where a stage's queries and
a KV block's keys and values come from: projected from the layer's input
(``staged_attention.AttentionProjections``, the fused ops) or read from given tensors
(``staged_attention``'s q/k/v entry). Query head ``h`` always uses KV head ``h // n_rep`` (the
model's own GQA grouping, ``head_schedule``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from upipe_dtensor.kernels.tiling import visited
from upipe_dtensor.modes.traces import per_trace
from upipe_dtensor.parallel.all_to_all import (
    Exchange,
    _group,
    sequence_to_heads,
    start_exchange,
    start_heads_to_sequence,
)
from upipe_dtensor.parallel.head_schedule import HeadSchedule, Stage, make_head_schedule
from upipe_dtensor.runtime.host_store import to_device


@per_trace  # cached on one plan's fake tensors: emptied between plans (modes.traces)
@functools.cache
def head_index(heads: tuple[int, ...], device: torch.device) -> Tensor:
    """A stage's head indices on ``device``, built once and sent without the host waiting
    (``host_store.to_device``): a blocking host-to-GPU copy stalls the CPU until the stream
    catches up."""
    return to_device(torch.tensor(heads), device)


def resolve_group(group_name: str, size: int) -> dist.ProcessGroup | None:
    """The process group named ``group_name`` (None for a group of one), checked for its size."""
    if size == 1:
        return None
    group = _group(group_name)
    if group.size() != size:
        raise ValueError(f"process group {group_name!r} has {group.size()} ranks, expected {size}")
    return group


class HeadStages:
    """One layer's head stages over a span of ``local_len`` tokens of the local sequence.
    Subclasses make a stage's queries (``query``), a KV block's keys (``key``) and values
    (``value``), each (B, L, heads, d) in the sequence layout; ``like`` is a tensor of the call
    (what the planner's loop shortcut asks whether it is fake)."""

    def __init__(
        self,
        like: Tensor,
        batch: int,
        local_len: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        head_group: str,
        head_degree: int,
        heads_per_stage: int,
    ) -> None:
        self.like = like
        self.batch, self.local_len, self.head_dim = batch, local_len, head_dim
        self.schedule: HeadSchedule = make_head_schedule(
            n_heads, n_kv_heads, head_degree, heads_per_stage
        )
        self.head_degree = head_degree
        self.group = resolve_group(head_group, head_degree)

    def query(self, stage: Stage, rope: Tensor | None) -> Tensor:
        """The stage's queries (B, L, U, d), as attention takes them (rotated)."""
        raise NotImplementedError

    def key(self, block: int, rope: Tensor | None) -> Tensor:
        """The KV block's keys (B, L, heads, d), as attention takes them (rotated)."""
        raise NotImplementedError

    def value(self, block: int) -> Tensor:
        """The KV block's values (B, L, heads, d)."""
        raise NotImplementedError

    def stage_order(self) -> list[int] | range:
        """The stages a stage loop runs, by index: every one, except when planning on fake
        tensors a schedule whose stages repeat (``HeadSchedule.stages_repeat``), where the first
        two and the last run, the second standing for the middle ones
        (``kernels.tiling.visited``). The stage buffers (output, LSEs) are allocated whole
        before the loop and every stage's head indices are built here (they are kept for the
        run), so a skipped stage leaves nothing behind; the visited stages allocate what every
        stage would, and count the work of all of them."""
        for stage in self.schedule.stages:
            if stage.first_head_if_contiguous is None:
                head_index(stage.query_heads, self.like.device)
        stages = range(len(self.schedule.stages))
        return visited(self.like, stages) if self.schedule.stages_repeat else stages

    def start_to_heads(self, make: Callable[[], Tensor]) -> Exchange:
        """Start the exchange of the (B, L, h, d) tensor ``make()`` makes to the head layout;
        that tensor is let go once its send copy exists (``all_to_all.sequence_to_heads``), so
        it, the send and the receive buffer are never all held at once."""
        if self.head_degree == 1:
            return Exchange.done(make())
        return start_exchange(*sequence_to_heads(make(), self.head_degree), self.group)

    def start_to_sequence(self, t: Tensor) -> Exchange:
        """Start the exchange of ``t`` (B, S, h, d) to the sequence layout (B, L, h*C_h, d). A
        kernel's output is usually its send layout already (with batch 1), so nothing is held
        twice."""
        return start_heads_to_sequence(t, self.group, self.head_degree)

    def to_heads(self, make: Callable[[], Tensor]) -> Tensor:
        return self.start_to_heads(make).result()

    def to_sequence(self, t: Tensor) -> Tensor:
        return self.start_to_sequence(t).result()

    def start_query_for_stage(self, stage: Stage, rope: Tensor | None) -> Exchange:
        """The stage's queries on their way to the head layout."""
        return self.start_to_heads(functools.partial(self.query, stage, rope))

    def start_key_for_block(self, block: int, rope: Tensor | None) -> Exchange:
        """The KV block's keys, replicated if needed, on their way to the head layout."""
        return self.start_to_heads(lambda: self.replicated(self.key(block, rope)))

    def start_value_for_block(self, block: int) -> Exchange:
        """The KV block's values, replicated if needed, on their way to the head layout."""
        return self.start_to_heads(lambda: self.replicated(self.value(block)))

    def query_for_stage(self, stage: Stage, rope: Tensor | None) -> Tensor:
        return self.start_query_for_stage(stage, rope).result()

    def kv_for_block(self, block: int, rope: Tensor | None) -> tuple[Tensor, Tensor]:
        """K and V of one KV block in the head layout."""
        k, v = self.start_key_for_block(block, rope), self.start_value_for_block(block)
        return k.result(), v.result()

    def replicated(self, kv: Tensor) -> Tensor:
        """``kv`` with each KV head repeated for the ranks that share it (fewer KV heads than
        head-axis ranks: ``HeadSchedule.kv_replication``)."""
        rep = self.schedule.kv_replication
        return kv.repeat_interleave(rep, dim=2) if rep > 1 else kv

    def kv_grad(self, grad_h: Tensor, dtype: torch.dtype) -> Tensor:
        """A KV block's K or V gradient from the head layout -> the model's KV heads on the local
        span (B, L, heads, d) in ``dtype``: the replicas of a KV head each got part of it, and
        are summed."""
        grad = self.to_sequence(grad_h.to(dtype))
        rep = self.schedule.kv_replication
        return grad.unflatten(2, (-1, rep)).sum(3) if rep > 1 else grad

    def write_lse(self, whole: Tensor, stage: Stage, lse: Tensor) -> None:
        """whole[:, :, stage heads] = the stage's LSE (B, U/C_h, S_h), head layout, back in
        the sequence layout; ``whole`` is (B, L, H, 1)."""
        self.write_stage(whole, stage, self.to_sequence(lse.transpose(1, 2).unsqueeze(-1)))

    def block_heads(self, block: int) -> slice:
        """The model's KV heads of ``block``."""
        return slice(*self.schedule.kv_block_heads(block))

    def read_stage(self, buffer: Tensor, stage: Stage) -> Tensor:
        """buffer[:, :, stage heads] of a (B, L, H, d) buffer: a view when they are contiguous."""
        first = stage.first_head_if_contiguous
        if first is not None:
            return buffer[:, :, first : first + len(stage.query_heads)]
        return buffer.index_select(2, head_index(stage.query_heads, buffer.device))

    def write_stage(self, buffer: Tensor, stage: Stage, values: Tensor) -> None:
        """buffer[:, :, stage heads] = values, for (B, L, H, d) buffers."""
        first = stage.first_head_if_contiguous
        if first is not None:
            buffer[:, :, first : first + values.shape[2]] = values
        else:
            buffer.index_copy_(2, head_index(stage.query_heads, buffer.device), values)


class GivenQKV(HeadStages):
    """Head stages whose queries, keys and values are given: (B, L, heads, d) ``q``, ``k``,
    ``v`` of a span of the local shard, already rotated (the styles' op-level entry)."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, params) -> None:
        batch, local_len, n_heads, head_dim = q.shape
        super().__init__(
            q,
            batch,
            local_len,
            n_heads,
            k.shape[2],
            head_dim,
            params.head_group,
            params.head_degree,
            params.heads_per_stage,
        )
        self.q, self.k, self.v = q, k, v

    def query(self, stage: Stage, rope: None) -> Tensor:
        return self.read_stage(self.q, stage)

    def key(self, block: int, rope: None) -> Tensor:
        return self.k[:, :, self.block_heads(block)]

    def value(self, block: int) -> Tensor:
        return self.v[:, :, self.block_heads(block)]

    def output_grad(self, grad_out: Tensor, stage: Stage) -> Tensor:
        """The stage's slice of ``grad_out`` (B, L, H, d) in the head layout."""
        return self.to_heads(functools.partial(self.read_stage, grad_out, stage))
