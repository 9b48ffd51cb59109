"""The CP-style registry: a style registered there alone is accepted by the config loader and
checks, built by parallelize's factory, described and priced by the planner's lookups; and the
styles stay as constructed when applied.

In-process on PyTorch's fake process group: nothing is traced or run.
"""

from __future__ import annotations

import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import tiny_llama
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from upipe_dtensor import RingAttention, UlyssesAttention, UPipeAttention
from upipe_dtensor.config import ConfigError, check_job, parse_args
from upipe_dtensor.jobs.parallelize import describe_cp_style, make_cp_style
from upipe_dtensor.parallel.layouts import two_d_positions
from upipe_dtensor.parallel.registry import STYLES, StyleSpec, register_style, style_names
from upipe_dtensor.planning.communication_volume import layer_traffic
from upipe_dtensor.planning.max_context import knobs, on_world
from upipe_dtensor.planning.step import _overlapped_stages

pytestmark = pytest.mark.unit

DEBUG = str(Path(__file__).resolve().parents[1] / "train_configs/debug_model.toml")
WORLD = 4


class ToyUlysses(UlyssesAttention):
    """A new style: Ulysses under another name (a different all-to-all would go here)."""


@pytest.fixture
def toy():
    spec = register_style(StyleSpec("toy", ToyUlysses, "Toy Ulysses", ring_axis=True))
    yield spec
    del STYLES["toy"]


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    yield
    dist.destroy_process_group()


def _config(*extra: str):
    return parse_args(["--config", DEBUG, "--parallelism.context_parallel_degree", "4", *extra])


def test_a_registered_style_runs_everywhere_without_other_edits(toy) -> None:
    config = _config("--parallelism.cp_style", "toy", "--parallelism.ring_degree", "2")
    check_job(config, world_size=WORLD)
    parallelism = config.parallelism
    assert parallelism.style is toy and parallelism.head_degree == 2
    assert parallelism.stage_heads(8) == 8 and parallelism.chunk_tokens == 0
    setup = types.SimpleNamespace(
        config=config,
        args=types.SimpleNamespace(n_heads=8),
        attention_backend="sdpa",
        kernel_device=None,
        host_device=torch.device("cpu"),
    )
    style = make_cp_style(setup, None)
    assert type(style) is ToyUlysses and style.ring_degree == 2
    assert describe_cp_style(parallelism, 8) == "Toy Ulysses on a ring of 2 x 2 head ranks"
    assert _overlapped_stages(parallelism, 8) == 1
    assert on_world(config, 8, gpus_per_node=4).parallelism.ring_degree == 2
    assert "UPipe's setting" in knobs(config)["heads_per_stage"]
    traffic = layer_traffic(
        "toy", seq_len=64, batch=1, cp=4, ring_degree=2, n_heads=8, n_kv_heads=8,
        head_dim=16, heads_per_stage=8, dtype_bytes=2,
    )  # fmt: skip
    assert traffic == layer_traffic(
        "ulysses", seq_len=64, batch=1, cp=4, ring_degree=2, n_heads=8, n_kv_heads=8,
        head_dim=16, heads_per_stage=8, dtype_bytes=2,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="heads_per_stage does not apply to cp_style 'toy'"):
        staged = _config("--parallelism.cp_style", "toy", "--parallelism.heads_per_stage", "2")
        check_job(staged, WORLD)


def test_unknown_styles_list_the_registered_names(toy) -> None:
    assert style_names()[-1] == "toy"
    with pytest.raises(ConfigError, match=r"'zigzag' is not one of \[.*'fpdt', 'toy'\]"):
        _config("--parallelism.cp_style", "zigzag")
    config = _config()
    bad = replace(config, parallelism=replace(config.parallelism, cp_style="zigzag"))
    with pytest.raises(ConfigError, match=r"\[parallelism\] cp_style = 'zigzag' is not one of"):
        check_job(bad, WORLD)
    with pytest.raises(ValueError, match="already registered"):
        register_style(toy)


def test_make_refuses_options_a_style_does_not_take() -> None:
    with pytest.raises(ValueError, match="'ring' does not take heads_per_stage, chunk_tokens"):
        STYLES["ring"].make(heads_per_stage=2, chunk_tokens=8)
    with pytest.raises(ValueError, match="'fpdt' runs in sequence chunks"):
        STYLES["fpdt"].make()


def test_repr_shows_non_default_arguments() -> None:
    assert repr(UPipeAttention()) == "UPipeAttention()"
    assert (
        repr(UPipeAttention(heads_per_stage=4, overlap_stages=False, backend="sdpa"))
        == "UPipeAttention(heads_per_stage=4, overlap_stages=False, backend='sdpa')"
    )
    assert repr(UlyssesAttention(ring_degree=2)) == "UlyssesAttention(ring_degree=2)"
    assert repr(RingAttention()) == "RingAttention()"


def test_apply_leaves_the_style_as_constructed(fake_world) -> None:
    """The ring degree a mesh has goes to the per-module axes, not into the style's arguments;
    the style still lays out its shard after apply."""
    style = UPipeAttention()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_ring", "cp_heads"))
    model = parallelize_module(tiny_llama(4, 4, seq_len=16), mesh, {"layers.*.attention": style})
    assert style.ring_degree is None and repr(style) == "UPipeAttention()"
    assert model.layers["0"].attention.cp_axes.ring_degree == 2
    assert torch.equal(style.shard_positions(16, 3, WORLD), two_d_positions(16, 3, WORLD, 2))
