"""Every memory-stack switch, alone and all together, leaves the loss and every gradient equal to
the plain path (float32), with UPipe and Ulysses, eager and compiled, on 2 and 4 gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import rel_err, run_on_ranks

from upipe_dtensor.config import parse_args
from upipe_dtensor.train.trainer import Trainer

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
SWITCHES = {
    "checkpoint": ["--activation_checkpoint.mode", "full"],
    "checkpoint+host_offload": [
        "--activation_checkpoint.mode",
        "full",
        "--activation_checkpoint.cpu_offload",
        "true",
        "--activation_checkpoint.cpu_offload_skip_last",
        "1",
    ],
    "tiled_mlp": ["--memory.tiled_mlp", "true", "--memory.mlp_tile_tokens", "5"],
    "tiled_rms_norm": ["--memory.tiled_rms_norm", "true", "--memory.norm_tile_tokens", "6"],
    "chunked_loss": ["--memory.chunked_loss", "true", "--memory.loss_chunk_tokens", "7"],
    "fsdp_cpu_offload": ["--training.enable_cpu_offload", "true"],
    "checkpoint+kept_attention": [
        "--activation_checkpoint.mode",
        "full",
        "--activation_checkpoint.keep_attention",
        "device",
    ],
    # Last: in ALL these override the per-block checkpointing above (later flags win).
    "checkpoint_pairs+host_offload": [
        "--activation_checkpoint.mode",
        "full",
        "--activation_checkpoint.cpu_offload",
        "true",
        "--activation_checkpoint.blocks_per_checkpoint",
        "2",
        "--activation_checkpoint.cpu_offload_prefetch",
        "false",
        "--activation_checkpoint.keep_attention",
        "host",
        "--activation_checkpoint.keep_attention_skip_first",
        "1",  # block 0 recomputes its attention, block 1 of its pair keeps it
    ],
}
ALL = [arg for args in SWITCHES.values() for arg in args]
TOL = 1e-5


def _loss_and_grads(
    tmp: str, world: int, style: str, extra: list[str]
) -> tuple[torch.Tensor, dict]:
    config = parse_args(
        [
            "--config",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            tmp,
            "--training.seq_len",
            str(16 * world),
            "--training.local_batch_size",
            "2",
            "--parallelism.context_parallel_degree",
            str(world),
            "--parallelism.cp_style",
            style,
            "--checkpoint.enable",
            "false",
            "--metrics.enable_tensorboard",
            "false",
            *extra,
        ]
    )
    trainer = Trainer(config)
    inputs, labels = next(iter(trainer.dataloader))
    loss = trainer.parallel(trainer.shard_sequence(inputs), labels=trainer.shard_sequence(labels))
    loss.backward()
    grads = {  # checkpoint wrappers nest blocks one level down; state dicts hide that too
        n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor().detach().clone()
        for n, p in trainer.model.named_parameters()
    }
    loss = loss.detach()
    torch.distributed.all_reduce(loss)
    return loss, grads


def _compare(
    rank: int, world: int, tmp: str, style: str, configs: dict[str, list[str]], compile_: bool
) -> None:
    reference_loss, reference = _loss_and_grads(tmp, world, style, [])
    failures = []
    for name, extra in configs.items():
        if compile_:
            extra = [*extra, "--compile.enable", "true"]
        loss, grads = _loss_and_grads(tmp, world, style, extra)
        errors = {"loss": rel_err(loss, reference_loss)}
        errors.update({n: rel_err(grads[n], g) for n, g in reference.items()})
        failures += [f"{name}: {k} rel err {e:.2e}" for k, e in errors.items() if not e <= TOL]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("style", ["upipe", "ulysses"])
def test_each_switch_alone_and_all_together(tmp_path: Path, style: str) -> None:
    run_on_ranks(2, _compare, str(tmp_path), style, {**SWITCHES, "all": ALL}, False)


@pytest.mark.parametrize("style", ["upipe", pytest.param("ulysses", marks=pytest.mark.slow)])
def test_all_switches_compiled(tmp_path: Path, style: str) -> None:
    run_on_ranks(2, _compare, str(tmp_path), style, {"all": ALL}, True)


def test_all_switches_on_four_ranks(tmp_path: Path) -> None:
    run_on_ranks(4, _compare, str(tmp_path), "upipe", {"all": ALL}, False)
