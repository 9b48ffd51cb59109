"""The 8B and 32B flavors build, shard (FSDP2 over dp x cp, UPipe over cp) and run one training
step at their real width, on a fake process group with fake tensors: no memory, no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from upipe_dtensor.config import parse_args
from upipe_dtensor.train.build import Placement
from upipe_dtensor.train.setup import build_meshes
from upipe_dtensor.train.trainer import Trainer

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "flavor,world,cp,params",
    [("8B", 8, 8, 8_030_261_248), ("32B", 16, 16, 32_519_623_680)],  # 32B: 8 KV heads < 16 ranks
)
def test_flavor_builds_shards_and_steps(
    tmp_path: Path, flavor: str, world: int, cp: int, params: int
) -> None:
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        config = parse_args(
            [
                "--config",
                str(REPO / "train_configs/debug_model.toml"),
                "--job.dump_folder",
                str(tmp_path),
                "--model.flavor",
                flavor,
                "--training.seq_len",
                str(4 * cp),
                "--training.local_batch_size",
                "1",
                "--parallelism.context_parallel_degree",
                str(cp),
                "--checkpoint.enable",
                "false",
                "--metrics.enable_tensorboard",
                "false",
            ]
        )
        meshes = build_meshes("cpu", world // cp, cp)
        with FakeTensorMode(allow_non_fake_inputs=True):
            trainer = Trainer(config, placement=Placement(meshes=meshes))
            local = [p.to_local() for p in trainer.model.parameters()]
            assert sum(p.numel() for p in trainer.model.parameters()) == params
            assert (
                sum(t.numel() for t in local) <= params // world + 10**6
            )  # sharded over all ranks
            loss, grad_norm = trainer.train_step([next(iter(trainer.dataloader))])
            assert loss.shape == () and grad_norm.shape == ()
            assert trainer.optimizer.state  # the optimizer step ran and made its state
    finally:
        dist.destroy_process_group()
