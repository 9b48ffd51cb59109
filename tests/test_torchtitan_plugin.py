"""The torchtitan 0.2.2 plug-in (``upipe_dtensor.integrations.torchtitan.tt022``) inside
torchtitan's own ``Trainer``: its debug model, 10 steps, CP 2 on CPU gloo ranks, losses equal to
torchtitan's trainer without CP; and a load balancer that would feed the style the wrong tokens
is refused. Skipped on torchtitan 0.3.0 (``test_torchtitan_plugin_030.py``).

torchtitan 0.2.2 does not run on CPU as shipped; ``torchtitan_cpu.torchtitan_on_cpu`` patches,
in the rank processes only, exactly what these runs need (device detection, FSDP's PREMUL_SUM).
Every run starts from one seed checkpoint written by the baseline, torchtitan's documented way
to compare parallelisms (FSDP's sharded initialisation draws other numbers than an unsharded
one).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import types
from pathlib import Path
from unittest import mock

import pytest
import torch
from harness import run_on_ranks
from torchtitan_cpu import torchtitan_on_cpu

from upipe_dtensor.integrations.torchtitan import (
    UPipe,
    check_load_balancer,
    make_cp_style,
    parallelize_with_style,
    torchtitan_layout,
)
from upipe_dtensor.models.generation import GENERATION
from upipe_dtensor.parallel.registry import make_style
from upipe_dtensor.parallel.style_options import Geometry

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(GENERATION != "tt022", reason="torchtitan 0.2.2's plug-in"),
]

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = "upipe_dtensor.integrations.torchtitan"
STEPS = 10


def _common_args(data: Path, dump: Path) -> list[str]:
    """torchtitan's debug model on the shipped tokenizer and corpus, float32 throughout."""
    return [
        "--model.flavor=debugmodel",
        f"--model.hf_assets_path={ROOT / 'assets' / 'tokenizer'}",
        "--training.dataset=c4_test",
        f"--training.dataset_path={data}",
        "--training.seq_len=64",
        "--training.local_batch_size=2",
        f"--training.steps={STEPS}",
        "--training.mixed_precision_param=float32",
        "--debug.seed=0",  # the same seed checkpoint, so the same losses, every run
        "--lr_scheduler.warmup_steps=2",
        "--lr_scheduler.min_lr_factor=1",  # constant after warmup, as in _project_trainer_args
        "--metrics.log_freq=1",
        "--checkpoint.enable",
        f"--job.dump_folder={dump}",
    ]


def _train(trainer_class: type, args: list[str], *, save_seed: bool = False) -> list[float]:
    """Build ``trainer_class`` from torchtitan's command line ``args``, train, and return the
    loss torchtitan logs at every step (its global average over the ranks)."""
    from torchtitan.config import ConfigManager

    trainer = trainer_class(ConfigManager().parse_args(args))
    losses: list[float] = []
    log = trainer.metrics_processor.log

    def record(step, global_avg_loss, *rest, **kwargs):
        losses.append(float(global_avg_loss))
        return log(step, global_avg_loss, *rest, **kwargs)

    trainer.metrics_processor.log = record
    try:
        if save_seed:  # what `torchtitan.train --checkpoint.create_seed_checkpoint` does
            trainer.checkpointer.save(curr_step=0, last_step=True)
        trainer.train()
    finally:
        trainer.close()
    return losses


def _baseline(rank: int, world_size: int, common: list[str], out: Path) -> None:
    """torchtitan's own llama3 spec on one rank, no CP; writes the seed checkpoint."""
    from torchtitan.train import Trainer

    with torchtitan_on_cpu(rank):
        out.write_text(
            json.dumps(_train(Trainer, [*common, "--model.name=llama3"], save_seed=True))
        )


def _project_trainer_args(data: Path, hf_config: Path, seed: Path, dump: Path) -> list[str]:
    """This project's train.py on the same model (torchtitan's debug model as a config.json),
    weights (the seed checkpoint), data, optimizer, schedule and style as the plug-in's run."""
    return [
        "--config",
        str(ROOT / "train_configs" / "debug_model.toml"),
        f"--job.dump_folder={dump}",
        "--model.flavor=hf",
        f"--model.hf_assets_path={hf_config}",
        f"--checkpoint.initial_load_path={seed}",
        "--checkpoint.enable=false",
        f"--training.dataset_path={data}",
        "--training.seq_len=64",
        "--training.local_batch_size=2",
        f"--training.steps={STEPS}",
        "--optimizer.lr=8e-4",
        "--lr_scheduler.warmup_steps=2",
        "--lr_scheduler.min_lr_factor=1",
        "--parallelism.heads_per_stage=8",
        "--metrics.enable_tensorboard=false",
    ]


def _with_plugin(
    rank: int, world_size: int, common: list[str], seed: Path, ours: list[str], out: Path
) -> None:
    """On 2 ranks, cp 2: the mismatched balancer refused by torchtitan's Trainer (and, with the
    check disabled, one step of what it would have trained), then UPipe in torchtitan's Trainer
    (torchtitan cuts the sequence), FPDT in the plug-in's ``UPipeTrainer`` (the style cuts it:
    chunk-strided), and this project's trainer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.context_parallel import cp_shard
    from torchtitan.train import Trainer

    from upipe_dtensor.integrations.torchtitan import UPipeTrainer
    from upipe_dtensor.integrations.torchtitan import tt022 as plugin_module

    for balancer in (None, "headtail"):  # the plug-in's model of how torchtitan cuts sequences
        (cut,), _ = cp_shard(
            init_device_mesh("cpu", (2,)), (torch.arange(64)[None],), None, balancer
        )
        assert torch.equal(cut[0], torchtitan_layout(balancer, 64, 2)[rank]), balancer
    plugin = [
        *common,
        f"--experimental.custom_import={PLUGIN}",
        f"--job.custom_config_module={PLUGIN}",
        "--model.name=llama3_upipe",
        "--parallelism.context_parallel_degree=2",
        f"--checkpoint.initial_load_path={seed}",
    ]
    losses = {}
    with torchtitan_on_cpu(rank):
        headtail = [
            *plugin,
            "--upipe.heads_per_stage=8",
            "--parallelism.context_parallel_load_balancer=headtail",
        ]
        with pytest.raises(ValueError) as refused:
            _train(Trainer, headtail)
        losses["refusal"] = str(refused.value)
        with mock.patch.object(plugin_module, "check_load_balancer", lambda *_: None):
            losses["unchecked headtail"] = _train(
                Trainer, [*headtail, "--training.steps=1", "--checkpoint.folder=unchecked"]
            )
        losses["upipe"] = _train(  # with the tiled MLP and RMSNorm, which carry over
            Trainer,
            [
                *plugin,
                "--upipe.heads_per_stage=8",
                "--upipe.tiled_mlp",
                "--upipe.tiled_rms_norm",
                "--checkpoint.folder=upipe",
            ],
        )
        losses["fpdt"] = _train(
            UPipeTrainer,
            [
                *plugin,
                "--upipe.cp_style=fpdt",
                "--upipe.chunk_tokens=32",
                "--activation_checkpoint.mode=none",
                "--checkpoint.folder=fpdt",
            ],
        )
    from upipe_dtensor.config import parse_args
    from upipe_dtensor.train.trainer import Trainer as ProjectTrainer

    losses["this project's trainer"] = ProjectTrainer(parse_args(ours)).train()
    if rank == 0:
        out.write_text(json.dumps(losses))


def _debugmodel_as_hf_config() -> dict:
    """torchtitan's llama3 debug model as a Hugging Face config.json (this project's trainer
    reads a shape it has no flavor for from one)."""
    from torchtitan.models.llama3 import Transformer, llama3_args

    args = llama3_args["debugmodel"]
    with torch.device("meta"):
        ffn_dim = Transformer(args).layers["0"].feed_forward.w1.weight.shape[0]
    scaling = args.rope_scaling_args
    return {
        "model_type": "llama",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "intermediate_size": ffn_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": scaling.scaling_factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        },
    }


def test_upipe_in_torchtitans_trainer_equals_it_without_cp(tmp_path: Path) -> None:
    data = tmp_path / "data"  # the corpus as one .jsonl: torchtitan's loader reads a folder
    data.mkdir()
    shutil.copy(ROOT / "assets" / "corpus" / "stdlib_docs.jsonl", data)
    common = _common_args(data, tmp_path / "dump")
    hf_config = tmp_path / "debugmodel"
    hf_config.mkdir()
    (hf_config / "config.json").write_text(json.dumps(_debugmodel_as_hf_config()))

    run_on_ranks(1, _baseline, common, tmp_path / "baseline.json")
    baseline = json.loads((tmp_path / "baseline.json").read_text())
    seed = tmp_path / "dump" / "checkpoint" / "step-0"
    ours = _project_trainer_args(data, hf_config, seed, tmp_path / "ours")
    run_on_ranks(2, _with_plugin, common, seed, ours, tmp_path / "plugin.json")
    runs = json.loads((tmp_path / "plugin.json").read_text())

    refusal = runs.pop("refusal")
    assert "\n" not in refusal
    assert "context_parallel_load_balancer = 'headtail'" in refusal
    assert "--parallelism.context_parallel_load_balancer None" in refusal
    (unchecked,) = runs.pop("unchecked headtail")  # what the refusal prevents: a wrong loss,
    assert unchecked != pytest.approx(baseline[0], rel=1e-5, abs=0)  # which this comparison sees
    assert len(baseline) == STEPS and baseline[-1] < baseline[0]  # it trains
    for name, losses in runs.items():
        assert losses == pytest.approx(baseline, rel=1e-5, abs=0), name


@pytest.mark.parametrize(
    ("values", "balancer", "fix"),
    [
        ({"cp_style": "upipe"}, "headtail", "--parallelism.context_parallel_load_balancer None"),
        ({"cp_style": "ulysses"}, "headtail", "--parallelism.context_parallel_load_balancer None"),
        ({"cp_style": "ring"}, None, "context_parallel_load_balancer = 'headtail'"),
        ({"cp_style": "fpdt", "chunk_tokens": 16}, None, "-m upipe_dtensor.integrations"),
        ({"cp_style": "upipe", "chunk_tokens": 16}, "headtail", "-m upipe_dtensor.integ"),
        ({"cp_style": "upipe"}, "ptrr", "--parallelism.context_parallel_load_balancer None"),
    ],
)
def test_a_balancer_that_is_not_the_styles_layout_is_refused(values, balancer, fix) -> None:
    style = make_style(values, Geometry(ring_degree=1))
    with pytest.raises(ValueError) as refused:
        check_load_balancer(style, balancer, 64, 4)
    assert "\n" not in str(refused.value) and fix in str(refused.value)


@pytest.mark.parametrize(
    ("values", "balancer"),
    [
        ({"cp_style": "upipe"}, None),
        ({"cp_style": "ulysses"}, None),
        ({"cp_style": "ring"}, "headtail"),
        ({"cp_style": "fpdt", "chunk_tokens": 64}, None),  # one chunk: contiguous
    ],
)
def test_the_balancer_of_the_styles_layout_is_accepted(values, balancer) -> None:
    check_load_balancer(make_style(values, Geometry(ring_degree=1)), balancer, 64, 4)


def test_the_shipped_torchtitan_job_file_trains_llama3_with_upipe() -> None:
    """docs/torchtitan.md's job file, read by torchtitan's own ConfigManager: the plug-in's spec,
    its [upipe] style valid for Llama3-8B on the file's cp degree and sequence, and the balancer
    the file leaves at the plug-in's default feeding that style its layout."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3 import llama3_args

    path = ROOT / "train_configs" / "torchtitan" / "llama3_8b_upipe.toml"
    config = ConfigManager().parse_args([f"--job.config_file={path}"])
    assert config.model.name == "llama3_upipe" and config.experimental.custom_import == PLUGIN
    cp, seq_len = config.parallelism.context_parallel_degree, config.training.seq_len
    style = make_cp_style(llama3_args[config.model.flavor], config.upipe, cp, seq_len)
    assert type(style).__name__ == "UPipeAttention" and config.upipe.tiled_mlp
    check_load_balancer(style, config.parallelism.context_parallel_load_balancer, seq_len, cp)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"heads_per_stage": 12}, "[upipe] n_heads=32 is not divisible by heads_per_stage=12"),
        ({"cp_style": "ring", "chunk_tokens": 4096}, "does not apply to cp_style 'ring'"),
        ({"ring_degree": 2}, "ring_degree = 2: 2D context parallelism needs a (cp_ring"),
    ],
)
def test_upipe_settings_are_checked_as_parallelism_is(settings, message) -> None:
    from torchtitan.models.llama3 import llama3_args

    with pytest.raises(ValueError) as refused:
        make_cp_style(llama3_args["8B"], UPipe(**settings), 8, 8192)
    assert "\n" not in str(refused.value) and message in str(refused.value)


def test_tensor_parallelism_is_refused() -> None:
    dims = types.SimpleNamespace(tp_enabled=True, tp=2)
    with pytest.raises(ValueError, match="tensor_parallel_degree = 2: .* set tensor_parallel_deg"):
        parallelize_with_style(None, dims, types.SimpleNamespace(upipe=UPipe()), then=None)


def _untied_qwen3() -> contextlib.AbstractContextManager:
    """torchtitan's Qwen3 debug model with its own output layer: torchtitan 0.2.2's FSDP refuses
    tied embeddings whenever dp_shard x cp > 1, with or without the plug-in."""
    from torchtitan.models.qwen3 import qwen3_args

    return mock.patch.object(qwen3_args["debugmodel"], "enable_weight_tying", False)


def _qwen3_baseline(rank: int, world_size: int, common: list[str], out: Path) -> None:
    from torchtitan.train import Trainer

    with torchtitan_on_cpu(rank), _untied_qwen3():
        losses = _train(Trainer, [*common, "--model.name=qwen3"], save_seed=True)
    out.write_text(json.dumps(losses))


def _qwen3_with_plugin(rank: int, world_size: int, common: list[str], seed: Path, out: Path):
    from torchtitan.train import Trainer

    plugin = [
        *common,
        f"--experimental.custom_import={PLUGIN}",
        f"--job.custom_config_module={PLUGIN}",
        "--model.name=qwen3_upipe",
        "--parallelism.context_parallel_degree=2",
        f"--checkpoint.initial_load_path={seed}",
    ]
    losses = {}
    with torchtitan_on_cpu(rank), _untied_qwen3():
        losses["upipe"] = _train(Trainer, [*plugin, "--checkpoint.folder=upipe"])
        losses["upipe compiled, tiled, full AC"] = _train(
            Trainer,
            [
                *plugin,
                "--compile.enable",
                "--compile.backend=aot_eager",
                "--upipe.tiled_mlp",
                "--upipe.tiled_rms_norm",
                "--activation_checkpoint.mode=full",
                "--checkpoint.folder=compiled",
            ],
        )
    if rank == 0:
        out.write_text(json.dumps(losses))


@pytest.mark.slow
def test_qwen3_and_compile_in_torchtitans_trainer_equal_it_without_cp(tmp_path: Path) -> None:
    """``qwen3_upipe`` (QK-norm, rotate-half RoPE, 8 KV heads) at cp = 2, eager and through
    torchtitan's own per-block compile (aot_eager: CPU inductor takes minutes) with the tiles
    and full AC: torchtitan's Qwen3 without CP's losses over 4 steps."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(ROOT / "assets" / "corpus" / "stdlib_docs.jsonl", data)
    common = [*_common_args(data, tmp_path / "dump"), "--training.steps=4"]
    run_on_ranks(1, _qwen3_baseline, common, tmp_path / "baseline.json")
    baseline = json.loads((tmp_path / "baseline.json").read_text())
    seed = tmp_path / "dump" / "checkpoint" / "step-0"
    run_on_ranks(2, _qwen3_with_plugin, common, seed, tmp_path / "plugin.json")
    for name, losses in json.loads((tmp_path / "plugin.json").read_text()).items():
        assert losses == pytest.approx(baseline, rel=1e-5, abs=0), name
