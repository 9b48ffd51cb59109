"""Bad geometry and misuse fail at parallelize_module (or the first forward) with a clear fix.

Runs in-process on PyTorch's fake process group, so any CP degree can be tried without spawning.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import tiny_llama
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from upipe_dtensor import RingAttention, UlyssesAttention, UPipeAttention
from upipe_dtensor.parallel.layouts import two_d_positions

pytestmark = pytest.mark.unit

WORLD = 8


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    yield
    dist.destroy_process_group()


def _apply(model, style, shape=(WORLD,), names=None, path="layers.*.attention"):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return parallelize_module(model, mesh, {path: style})


def test_heads_per_stage_must_divide_heads(fake_world) -> None:
    with pytest.raises(
        ValueError, match=r"n_heads=32 is not divisible by heads_per_stage=12.*\[8, 16, 32\]"
    ):
        _apply(tiny_llama(32, 8, seq_len=64), UPipeAttention(heads_per_stage=12))


def test_heads_must_split_over_ranks(fake_world) -> None:
    with pytest.raises(ValueError, match="n_heads=4 is not divisible by the cp degree 8"):
        _apply(tiny_llama(4, 4, seq_len=64), UlyssesAttention())


def test_mesh_dimensions_are_checked(fake_world) -> None:
    with pytest.raises(ValueError, match=r"1-D context-parallel mesh.*mesh\['cp'\]"):
        _apply(tiny_llama(8, 8, seq_len=64), RingAttention(), shape=(2, 4), names=("dp", "cp"))
    with pytest.raises(ValueError, match=r"1-D or 2-D context-parallel mesh"):
        _apply(
            tiny_llama(8, 8, seq_len=64), UPipeAttention(), shape=(2, 2, 2), names=("a", "b", "c")
        )
    # A 2-D mesh is (ring, heads) for UPipe: the (dp, cp) world mesh by mistake is refused.
    with pytest.raises(ValueError, match=r"must be \('cp_ring', 'cp_heads'\).*got \('dp', 'cp'\)"):
        _apply(tiny_llama(8, 8, seq_len=64), UPipeAttention(), shape=(2, 4), names=("dp", "cp"))


def test_layout_is_known_before_apply_or_refused(fake_world) -> None:
    """shard_positions never returns a layout for the wrong mesh: the ring degree is given at
    construction (and checked against the mesh), or the call before parallelize_module raises."""
    with pytest.raises(ValueError, match=r"ring degree.*after parallelize_module.*ring_degree=R"):
        UPipeAttention().shard_positions(64, 0, WORLD)
    style = UPipeAttention(ring_degree=2)
    before = style.shard_positions(64, 5, WORLD)
    assert torch.equal(before, two_d_positions(64, 5, WORLD, 2))
    _apply(tiny_llama(8, 8, seq_len=64), style, shape=(2, 4), names=("cp_ring", "cp_heads"))
    assert torch.equal(style.shard_positions(64, 5, WORLD), before)
    learned = UPipeAttention()  # no ring degree given: the mesh says it
    _apply(tiny_llama(8, 8, seq_len=64), learned, shape=(2, 4), names=("cp_ring", "cp_heads"))
    assert torch.equal(learned.shard_positions(64, 5, WORLD), before)
    with pytest.raises(
        ValueError, match=r"ring_degree=1\) applied to a mesh whose ring axis has 2"
    ):
        _apply(
            tiny_llama(8, 8, seq_len=64),
            UlyssesAttention(ring_degree=1),
            shape=(2, 4),
            names=("cp_ring", "cp_heads"),
        )


def test_applies_only_to_registered_attention(fake_world) -> None:
    with pytest.raises(ValueError, match="FeedForward is not one.*'layers.\\*.attention'"):
        _apply(tiny_llama(8, 8, seq_len=64), UPipeAttention(), path="layers.*.feed_forward")


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        UPipeAttention(backend="xformers")


def test_sequence_longer_than_rope_table(fake_world) -> None:
    model = _apply(tiny_llama(8, 8, seq_len=64), UPipeAttention())
    with pytest.raises(ValueError, match=r"sequence length 128 .* max_seq_len >= 128"):
        model(torch.zeros(1, 16, dtype=torch.long))  # 16 local tokens x 8 ranks > 64


def test_positions_shape_is_checked(fake_world) -> None:
    model = _apply(tiny_llama(8, 8, seq_len=64), UPipeAttention())
    with pytest.raises(ValueError, match=r"positions must be \(1, 4\) or \(B, 4\)"):
        model(torch.zeros(1, 4, dtype=torch.long), positions=torch.arange(4))


def test_attention_entry_refuses_what_does_not_fit(fake_world) -> None:
    """The op-level entry (``style.attention``) checks shapes and geometry before any
    exchange."""
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    q = torch.randn(1, 8, 2 * WORLD, 8)
    with pytest.raises(ValueError, match=r"give \(B, S/C, H, d\) queries"):
        UPipeAttention(ring_degree=1).attention(q, q[..., :4], q[..., :4], mesh)
    with pytest.raises(ValueError, match="is not divisible by heads_per_stage"):
        UPipeAttention(heads_per_stage=3, ring_degree=1).attention(q, q, q, mesh)
