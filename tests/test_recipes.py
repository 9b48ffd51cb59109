"""Every recipe parses, validates, and builds its model and full parallel plan (UPipe/Ulysses,
memory stack, FSDP2) at its real size and world size, on a fake process group with fake tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from upipe_dtensor.config import check_job, parse_args
from upipe_dtensor.memory.offload import HostOffload
from upipe_dtensor.parallelize import build_meshes
from upipe_dtensor.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (REPO / "recipes").glob("*.toml") if not p.stem.endswith("_base"))


def test_recipe_table_is_complete() -> None:
    names = {p.stem for p in RECIPES}
    for length in ("128K", "256K", "512K", "1M", "2M", "3M", "4M", "5M"):
        assert {f"llama3_8b_{length}", f"llama3_8b_ulysses_{length}"} <= names
    assert {"llama3_32b_4M", "llama3_32b_ulysses_4M"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_builds(recipe: Path, tmp_path: Path) -> None:
    config = parse_args(["--config", str(recipe), "--job.dump_folder", str(tmp_path)])
    world = config.parallelism.context_parallel_degree
    dp = check_job(config, world)
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        meshes = build_meshes("cpu", dp, world)
        with FakeTensorMode(allow_non_fake_inputs=True):
            trainer = Trainer(config, meshes=meshes)
        assert trainer.model.model_args.max_seq_len == config.training.seq_len
        assert isinstance(trainer.host_offload, HostOffload)  # every recipe offloads block inputs
        assert trainer.model.loss_chunk_tokens == config.memory.loss_chunk_tokens
    finally:
        dist.destroy_process_group()
