"""Qwen3 (QK-norm before RoPE, rotate-half RoPE) under every CP style == torchtitan's unsharded
Qwen3 model: logits and every gradient (the q_norm/k_norm weights' included), causal and with
documents, in float32; UPipe in bf16 within 1.5x of the unsharded bf16 model's error. Each style
once (the style x geometry grid runs on Llama3 in ``test_equivalence``)."""

from __future__ import annotations

import pytest
import torch
from harness import run_on_ranks
from test_equivalence import _grid

pytestmark = pytest.mark.distributed

QWEN3 = dict(family="qwen3", n_heads=8, n_kv=4)


def test_every_style_on_two_ranks() -> None:
    grid = [
        QWEN3 | dict(style="upipe", u=2, seq_len=8),
        QWEN3 | dict(style="ulysses", u=8, seq_len=10),
        QWEN3 | dict(style="ring", seq_len=8),
        QWEN3 | dict(style="fpdt", chunks=2, seq_len=8),
        QWEN3 | dict(style="fpdt", chunks=2, u=2, seq_len=8),  # UPipe x FPDT
        QWEN3 | dict(style="upipe", u=2, seq_len=8, docs="document"),
        QWEN3 | dict(style="ring", seq_len=8, docs="global"),
    ]
    run_on_ranks(2, _grid, torch.float32, grid)


def test_bf16_upipe_within_one_and_a_half_times_the_unsharded_error() -> None:
    grid = [QWEN3 | dict(style="upipe", u=2, seq_len=64, bf16_factor=1.5, bf16_slack=0.0)]
    run_on_ranks(2, _grid, torch.bfloat16, grid)


def test_2d_and_fewer_kv_heads_than_ranks_on_four_ranks() -> None:
    grid = [
        QWEN3 | dict(style="upipe2d", ring=2, u=2, seq_len=16),
        QWEN3 | dict(style="upipe", n_kv=2, u=4, seq_len=16),
        QWEN3 | dict(style="fpdt", chunks=2, seq_len=16, docs="document"),
    ]
    run_on_ranks(4, _grid, torch.float32, grid)
