"""Which query and KV heads each UPipe stage moves, and the geometry checks behind it.

The schedule is pure integer bookkeeping, so it is computed once per (H, H_kv, C, U) and shared
by the forward and backward loops. It encodes the rule that keeps pretrained checkpoints valid:
query head ``h`` always attends with KV head ``h // n_rep`` (the model's own GQA grouping). Each
stage therefore sends rank ``r`` only query heads whose KV head rank ``r`` already holds, and the
stage's rows of ``wq`` are gathered in that order (weights are small; activations never move).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """One step of the head loop: ``heads_per_stage`` query heads, in all-to-all send order."""

    query_heads: tuple[int, ...]
    kv_block: int
    opens_kv_block: bool
    closes_kv_block: bool

    @property
    def first_head_if_contiguous(self) -> int | None:
        """The first head when the stage's heads are consecutive (a slice, no gather needed)."""
        first = self.query_heads[0]
        if self.query_heads == tuple(range(first, first + len(self.query_heads))):
            return first
        return None


@dataclass(frozen=True)
class HeadSchedule:
    """The full stage plan of one attention layer for a CP group of ``head_degree`` ranks.

    ``kv_replication`` > 1 means there are fewer KV heads than ranks: each KV head is repeated
    that many times in activation space before the all-to-all, so every rank gets one.
    A *KV block* is the set of KV heads projected and communicated together; each rank holds
    ``kv_heads_per_rank`` of them while the block's stages run.
    """

    n_heads: int
    n_kv_heads: int
    head_degree: int
    heads_per_stage: int
    kv_replication: int
    kv_heads_per_rank: int
    stages: tuple[Stage, ...]

    @property
    def query_heads_per_rank(self) -> int:
        return self.heads_per_stage // self.head_degree

    @property
    def n_kv_blocks(self) -> int:
        return self.stages[-1].kv_block + 1

    @property
    def stages_per_kv_block(self) -> int:
        """Stages that share one KV block (and add into its dK/dV): H/U for one block."""
        return len(self.stages) // self.n_kv_blocks

    @property
    def stages_repeat(self) -> bool:
        """Whether every stage between the second and the last does what the second does, from
        the same state: one KV block (the first stage opens it, the last closes it, the others
        add to its dK/dV) or one stage per block, and heads all contiguous or all gathered."""
        if self.n_kv_blocks > 1 and self.stages_per_kv_block > 1:
            return False
        return len({stage.first_head_if_contiguous is None for stage in self.stages}) == 1

    def kv_block_heads(self, block: int) -> tuple[int, int]:
        """[start, stop) of the model's KV heads (rows of wk/wv) projected for ``block``."""
        per_block = self.head_degree * self.kv_heads_per_rank // self.kv_replication
        return block * per_block, (block + 1) * per_block


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_heads_per_stage(n_heads: int, n_kv_heads: int, head_degree: int) -> list[int]:
    """All head-chunk sizes U that work for this geometry (empty if the CP degree itself cannot)."""
    if n_heads % head_degree or (n_kv_heads % head_degree and head_degree % n_kv_heads):
        return []
    n_rep = n_heads // max(n_kv_heads, head_degree)
    valid = []
    for u in _divisors(n_heads // head_degree):
        if n_rep % u == 0 or u % n_rep == 0:
            valid.append(u * head_degree)
    return valid


def _check_geometry(n_heads: int, n_kv_heads: int, head_degree: int, heads_per_stage: int) -> None:
    if head_degree < 1:
        raise ValueError(f"cp degree must be >= 1, got {head_degree}")
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(
            f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}: not a valid GQA model"
        )
    if n_heads % head_degree:
        ok = [c for c in _divisors(n_heads) if valid_heads_per_stage(n_heads, n_kv_heads, c)]
        raise ValueError(
            f"n_heads={n_heads} is not divisible by the cp degree {head_degree}: every rank must "
            "own "
            f"whole heads. Use a cp degree in {ok}."
        )
    if n_kv_heads % head_degree and head_degree % n_kv_heads:
        raise ValueError(
            f"n_kv_heads={n_kv_heads} and cp degree {head_degree} must divide one another (so KV "
            "heads "
            f"split evenly or replicate evenly across ranks). Use a cp degree that divides "
            f"{n_kv_heads} or is a multiple of it."
        )
    valid = valid_heads_per_stage(n_heads, n_kv_heads, head_degree)
    if heads_per_stage not in valid:
        reason = (
            f"n_heads={n_heads} is not divisible by heads_per_stage={heads_per_stage}"
            if heads_per_stage <= 0 or n_heads % heads_per_stage
            else f"heads_per_stage={heads_per_stage} is not a multiple of the cp degree "
            f"{head_degree}"
            if heads_per_stage % head_degree
            else f"heads_per_stage={heads_per_stage} gives {heads_per_stage // head_degree} "
            f"query heads per rank per stage, which neither divides nor is a multiple of the "
            f"{n_heads // max(n_kv_heads, head_degree)} query heads sharing a KV head"
        )
        raise ValueError(f"{reason}. Valid heads_per_stage for cp degree {head_degree}: {valid}")


@functools.cache
def make_head_schedule(
    n_heads: int, n_kv_heads: int, head_degree: int, heads_per_stage: int
) -> HeadSchedule:
    """Plan the stages; raises ValueError naming the numbers if the geometry cannot work."""
    _check_geometry(n_heads, n_kv_heads, head_degree, heads_per_stage)
    kv_replication = max(1, head_degree // n_kv_heads)
    effective_kv_heads = n_kv_heads * kv_replication  # >= head_degree
    n_rep = n_heads // effective_kv_heads  # query heads per (effective) KV head
    per_rank = heads_per_stage // head_degree
    kv_per_rank = max(1, per_rank // n_rep)
    stages_per_block = kv_per_rank * n_rep // per_rank
    n_blocks = effective_kv_heads // (head_degree * kv_per_rank)

    stages = []
    for block in range(n_blocks):
        for step in range(stages_per_block):
            heads = []
            for rank in range(head_degree):
                # Effective KV heads this rank receives from the block's all-to-all.
                first_kv = (block * head_degree + rank) * kv_per_rank
                first_q = first_kv * n_rep + step * per_rank
                heads.extend(range(first_q, first_q + per_rank))
            stages.append(
                Stage(
                    query_heads=tuple(heads),
                    kv_block=block,
                    opens_kv_block=step == 0,
                    closes_kv_block=step == stages_per_block - 1,
                )
            )
    return HeadSchedule(
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_degree=head_degree,
        heads_per_stage=heads_per_stage,
        kv_replication=kv_replication,
        kv_heads_per_rank=kv_per_rank,
        stages=tuple(stages),
    )
