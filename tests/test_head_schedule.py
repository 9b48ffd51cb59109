"""The stage plan: every query head once, paired with its own KV head, and clear geometry errors."""

from __future__ import annotations

import pytest

from upipe_dtensor.parallel.head_schedule import make_head_schedule, valid_heads_per_stage

pytestmark = pytest.mark.unit

GEOMETRIES = [
    (32, 8, 8),
    (64, 8, 8),
    (64, 8, 16),
    (32, 8, 4),
    (32, 8, 2),
    (16, 16, 4),
    (8, 1, 4),
    (8, 2, 1),
]


@pytest.mark.parametrize("n_heads,n_kv,cp", GEOMETRIES)
def test_each_rank_gets_heads_of_the_kv_head_it_holds(n_heads: int, n_kv: int, cp: int) -> None:
    for u in valid_heads_per_stage(n_heads, n_kv, cp):
        plan = make_head_schedule(n_heads, n_kv, cp, u)
        assert len(plan.stages) == n_heads // u
        sent = [h for stage in plan.stages for h in stage.query_heads]
        assert sorted(sent) == list(range(n_heads))
        n_rep = n_heads // n_kv
        for stage in plan.stages:
            start, stop = plan.kv_block_heads(stage.kv_block)
            # The block's model KV heads, replicated, then split evenly over the ranks.
            effective = [h for h in range(start, stop) for _ in range(plan.kv_replication)]
            per_rank = len(effective) // cp
            for rank in range(cp):
                held = set(effective[rank * per_rank : (rank + 1) * per_rank])
                mine = stage.query_heads[rank * plan.query_heads_per_rank :][
                    : plan.query_heads_per_rank
                ]
                assert {h // n_rep for h in mine} <= held


def test_kv_blocks_open_and_close_once() -> None:
    plan = make_head_schedule(32, 8, 8, 8)  # Llama3-8B on 8 ranks, U = C: 4 stages, 1 KV block
    assert [s.kv_block for s in plan.stages] == [0, 0, 0, 0]
    assert [s.opens_kv_block for s in plan.stages] == [True, False, False, False]
    assert [s.closes_kv_block for s in plan.stages] == [False, False, False, True]
    assert make_head_schedule(32, 8, 8, 32).n_kv_blocks == 1  # Ulysses: one stage
    assert make_head_schedule(64, 8, 16, 16).kv_replication == 2  # 32B on 16 ranks


@pytest.mark.parametrize(
    "args,message",
    [
        ((32, 8, 8, 12), "n_heads=32 is not divisible by heads_per_stage=12"),
        ((32, 8, 8, 4), "heads_per_stage=4 is not a multiple of the cp degree 8"),
        ((32, 8, 3, 3), "n_heads=32 is not divisible by the cp degree 3"),
        ((24, 6, 4, 4), "n_kv_heads=6 and cp degree 4 must divide one another"),
        ((48, 8, 4, 16), "neither divides nor is a multiple"),
    ],
)
def test_bad_geometry_names_the_numbers_and_a_fix(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        make_head_schedule(*args)
    assert "Use" in str(info.value) or "Valid heads_per_stage" in str(info.value)
