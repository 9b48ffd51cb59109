"""The CP-style registry: a style registered there alone, with an option of its own declared in
its options dataclass alone, is accepted by the config loader, its checks and ``--help``, built by
parallelize's factory, and described and priced by the planner's lookups; ``make_style`` (the
trainer's and a torchtitan plug-in's entry point) refuses what the config refuses; the Python
constructors' defaults are the options' declarations; and the styles stay as constructed when
applied.

In-process on PyTorch's fake process group: nothing is traced or run.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, fields, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import tiny_llama
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from upipe_dtensor import FPDTAttention, RingAttention, UlyssesAttention, UPipeAttention
from upipe_dtensor.config import ConfigError, check_job, config_help, load_config, parse_args
from upipe_dtensor.parallel.layouts import two_d_positions
from upipe_dtensor.parallel.registry import (
    STYLES,
    StyleSpec,
    make_style,
    register_style,
    style_names,
)
from upipe_dtensor.parallel.style_options import Geometry, OptionError, UlyssesOptions
from upipe_dtensor.planning.communication_volume import layer_traffic
from upipe_dtensor.planning.max_context import knobs, on_world
from upipe_dtensor.planning.step import _overlapped_stages
from upipe_dtensor.train.parallelize import describe_cp_style, make_cp_style

pytestmark = pytest.mark.unit

DEBUG = str(Path(__file__).resolve().parents[1] / "train_configs/debug_model.toml")
WORLD = 4


@dataclass(frozen=True)
class ToyOptions(UlyssesOptions):
    """A new style's options: Ulysses's, and one of its own."""

    exchange_hops: int = 1
    """Hops per all-to-all (a different exchange would read it)."""

    def check(self, geometry: Geometry) -> None:
        if self.exchange_hops < 1:
            raise OptionError(f"exchange_hops = {self.exchange_hops} must be >= 1", "exchange_hops")
        super().check(geometry)


class ToyUlysses(UlyssesAttention):
    """A new style: Ulysses under another name, with an option of its own (its constructor's
    keyword arguments are its options' fields: nothing else to write)."""

    Options = ToyOptions


@pytest.fixture
def toy():
    spec = register_style(StyleSpec("toy", ToyUlysses, "Toy Ulysses"))
    yield spec
    del STYLES["toy"]


@pytest.fixture(scope="module")
def fake_world():
    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    yield
    dist.destroy_process_group()


def _config(*extra: str):
    return parse_args(["--config", DEBUG, "--parallelism.context_parallel_degree", "4", *extra])


def test_a_registered_style_and_its_option_run_everywhere_without_other_edits(toy) -> None:
    config = _config(
        "--parallelism.cp_style", "toy", "--parallelism.ring_degree", "2",
        "--parallelism.exchange_hops", "3",
    )  # fmt: skip
    check_job(config, world_size=WORLD)
    parallelism = config.parallelism
    assert parallelism.style is toy and parallelism.options == ToyOptions(exchange_hops=3)
    assert parallelism.head_degree == 2 and parallelism.stage_heads(8) == 8
    assert "options of cp_style 'toy':\n    --parallelism.exchange_hops (int, default 1)\n" in (
        config_help()
    )
    assert "Hops per all-to-all" in config_help()
    setup = types.SimpleNamespace(
        config=config,
        args=types.SimpleNamespace(n_heads=8, n_kv_heads=4),
        tp=1,
        attention_backend="sdpa",
        kernel_device=None,
        host_device=torch.device("cpu"),
    )
    style = make_cp_style(setup, None)
    assert type(style) is ToyUlysses and style.ring_degree == 2
    assert repr(style) == "ToyUlysses(exchange_hops=3, ring_degree=2, backend='sdpa')"
    assert repr(ToyUlysses(exchange_hops=2)) == "ToyUlysses(exchange_hops=2)"
    assert describe_cp_style(parallelism, 8) == "Toy Ulysses on a ring of 2 x 2 head ranks"
    assert _overlapped_stages(parallelism, 8) == 1
    assert on_world(config, 8, gpus_per_node=4).parallelism.options.exchange_hops == 3
    assert "UPipe's setting" in knobs(config)["heads_per_stage"]
    traffic = layer_traffic(
        "toy", seq_len=64, batch=1, cp=4, ring_degree=2, n_heads=8, n_kv_heads=8,
        head_dim=16, heads_per_stage=8, dtype_bytes=2,
    )  # fmt: skip
    assert traffic == layer_traffic(
        "ulysses", seq_len=64, batch=1, cp=4, ring_degree=2, n_heads=8, n_kv_heads=8,
        head_dim=16, heads_per_stage=8, dtype_bytes=2,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"command line: .*exchange_hops = 0 must be >= 1"):
        check_job(_config("--parallelism.cp_style", "toy", "--parallelism.exchange_hops", "0"), 4)
    with pytest.raises(
        ConfigError, match=r"exchange_hops does not apply to cp_style 'upipe' \(an option of "
    ):
        check_job(_config("--parallelism.exchange_hops", "2"), WORLD)


def test_a_base_files_options_stay_with_its_style(toy, tmp_path: Path) -> None:
    """An option a base file set for its cp_style is dropped where a file extending it names a
    style that does not take it (a baseline extending a UPipe recipe); set beside that cp_style,
    or after it, it is refused naming where."""
    base = tmp_path / "base.toml"
    base.write_text(f'extends = "{DEBUG}"\n[parallelism]\ncp_style = "toy"\nexchange_hops = 2\n')
    child = tmp_path / "child.toml"
    child.write_text('extends = "base.toml"\n[parallelism]\ncp_style = "upipe"\n')
    config = load_config(str(child))
    assert config.parallelism.style_options == {}
    assert "parallelism.exchange_hops" not in config.sources
    check_job(config, world_size=2)
    with pytest.raises(ConfigError, match=r"child.toml: \[parallelism\] exchange_hops does not"):
        child.write_text(
            'extends = "base.toml"\n[parallelism]\ncp_style = "upipe"\nexchange_hops = 2\n'
        )
        check_job(load_config(str(child)), world_size=2)
    assert load_config(str(base)).parallelism.options == ToyOptions(exchange_hops=2)


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


def test_make_style_checks_as_the_config_does() -> None:
    """The entry point for a plug-in: options by their [parallelism] names, from a mapping or a
    namespace, refused and checked as a job file's are."""
    with pytest.raises(OptionError, match="heads_per_stage does not apply to cp_style 'ring'"):
        make_style({"cp_style": "ring", "heads_per_stage": 2})
    with pytest.raises(OptionError, match=r"fpdt_chunk_tokens: not a style option"):
        make_style({"cp_style": "upipe", "fpdt_chunk_tokens": 64})  # chunk_tokens, since 48
    with pytest.raises(OptionError, match=r"n_heads=8 is not divisible by heads_per_stage=3"):
        make_style({"cp_style": "upipe", "heads_per_stage": 3}, Geometry(8, 8, cp_degree=2))
    section = types.SimpleNamespace(  # a plug-in's section: every option, unset ones None
        cp_style="upipe", heads_per_stage=4, chunk_tokens=None, overlap_stages=None, lr=1e-3
    )
    style = make_style(section, Geometry(8, 8, cp_degree=2, ring_degree=1))
    assert repr(style) == "UPipeAttention(heads_per_stage=4, ring_degree=1)"
    assert make_style({"cp_style": "fpdt"}).chunk_tokens == 65536  # the paper's, by default


def test_constructors_default_to_the_declared_options() -> None:
    """The Python spelling of each built-in style is its options dataclass: unset arguments are
    the declared defaults, and a style made from options is the one the constructor makes."""
    for spec in STYLES.values():
        declared = spec.options()
        made = spec.style.from_options(declared)
        assert made.options == declared and repr(made) == repr(make_style({"cp_style": spec.name}))
    assert UPipeAttention().options == STYLES["upipe"].options()
    assert UlyssesAttention().options == STYLES["ulysses"].options()
    assert RingAttention().options == STYLES["ring"].options()
    assert FPDTAttention(chunk_tokens=65536).options == STYLES["fpdt"].options()


def test_repr_shows_non_default_arguments() -> None:
    assert repr(UPipeAttention()) == "UPipeAttention()"
    assert (
        repr(UPipeAttention(heads_per_stage=4, overlap_stages=True, backend="sdpa"))
        == "UPipeAttention(heads_per_stage=4, overlap_stages=True, backend='sdpa')"
    )
    assert repr(UlyssesAttention(ring_degree=2)) == "UlyssesAttention(ring_degree=2)"
    assert repr(RingAttention()) == "RingAttention()"


def test_apply_leaves_the_style_as_constructed(fake_world) -> None:
    """The ring degree a mesh has goes to the per-module axes, not into the style's arguments;
    the style still lays out its shard after apply, and refuses a second, different mesh, whose
    layout it could not also answer for."""
    style = UPipeAttention()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_ring", "cp_heads"))
    model = parallelize_module(tiny_llama(4, 4, seq_len=16), mesh, {"layers.*.attention": style})
    assert style.ring_degree is None and repr(style) == "UPipeAttention()"
    assert model.layers["0"].attention.cp_axes.ring_degree == 2
    assert torch.equal(style.shard_positions(16, 3, WORLD), two_d_positions(16, 3, WORLD, 2))
    parallelize_module(tiny_llama(4, 4, seq_len=16), mesh, {"layers.*.attention": style})
    with pytest.raises(ValueError, match=r"applied to a mesh already .* construct another style"):
        flat = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
        parallelize_module(tiny_llama(4, 4, seq_len=16), flat, {"layers.*.attention": style})


def test_the_docs_table_names_every_declared_option() -> None:
    """docs/training.md's row of each built-in style names each key its options declare."""
    training = (Path(__file__).resolve().parents[1] / "docs/training.md").read_text()
    for name in ("upipe", "ulysses", "ring", "fpdt"):
        (row,) = [line for line in training.splitlines() if line.startswith(f'| `"{name}"` |')]
        missing = [f.name for f in fields(STYLES[name].options) if f"`{f.name}" not in row]
        assert not missing, f"docs/training.md's {name} row does not name {missing}"
