"""The torchtitan 0.3.0 plug-in (``upipe_dtensor.integrations.torchtitan.tt030``) inside
torchtitan 0.3.0's own ``Trainer``: its Llama3 debug model (6 layers, 16 heads, vocabulary
2048), the shipped tokenizer and corpus, sequence 64, batch 2, 10 steps, float32, on CPU gloo
ranks, every run from one seed checkpoint (torchtitan's ``--checkpoint.create_seed_checkpoint``,
its way to compare parallelisms): UPipe at cp = 2 with torchtitan cutting the sequence, FPDT laid
out by the style and ring attention under torchtitan's ``headtail`` balancer equal torchtitan's
trainer without CP; a balancer that would feed UPipe the wrong tokens is refused in one line, and
the step it would have trained misses. Skipped on torchtitan 0.2.2
(``test_torchtitan_plugin.py``); the CPU patches are ``torchtitan_cpu``'s.

0.3.0's language models attend with flex or varlen attention; flex has no backward on CPU and
varlen is CUDA's, so the trained runs, the baseline and the plug-in alike, give torchtitan's model
its maskless ``ScaledDotProductAttention`` (causal over the whole sequence, RoPE at the loader's
per-document positions), and the plug-in then masks no documents either, as torchtitan's own
attention would not. The documents are checked in forward, where flex runs on CPU: the style
given ``document_ids_from_positions`` equals torchtitan's model under its own flex ``BlockMask``
built from the same positions.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from harness import gather_sequence, make_style, rel_err, run_on_ranks, shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan_cpu import torchtitan_on_cpu

from upipe_dtensor.data.documents import document_ids_from_positions, document_positions
from upipe_dtensor.models.generation import GENERATION

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(GENERATION != "tt030", reason="torchtitan 0.3.0's plug-in"),
]

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = "upipe_dtensor.integrations.torchtitan"
STEPS = 10


def _common_args(data: Path, dump: Path) -> list[str]:
    """torchtitan's debug model on the shipped tokenizer and corpus, float32 throughout."""
    return [
        "--config=llama3_debugmodel",
        f"--hf_assets_path={ROOT / 'assets' / 'tokenizer'}",
        "--dataloader.dataset=c4_test",
        f"--dataloader.dataset_path={data}",
        "--training.seq_len=64",
        "--training.local_batch_size=2",
        f"--training.steps={STEPS}",
        "--training.mixed_precision_param=float32",
        "--debug.seed=0",
        "--lr_scheduler.warmup_steps=2",
        "--metrics.log_freq=1",
        "--checkpoint.enable",
        f"--dump_folder={dump}",
    ]


def _build(args: list[str]):
    """The trainer torchtitan's ``train.py`` builds from ``args``, its attention maskless (the
    module docstring says why)."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.common import ScaledDotProductAttention

    config = ConfigManager().parse_args(args)
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config.build()


def _train(args: list[str]) -> list[float]:
    """Train as ``args`` say; the loss torchtitan logs at every step (its global average)."""
    trainer = _build(args)
    losses: list[float] = []
    log = trainer.metrics_processor.log

    def record(step, global_avg_loss, *rest, **kwargs):
        losses.append(float(global_avg_loss))
        return log(step, global_avg_loss, *rest, **kwargs)

    trainer.metrics_processor.log = record
    try:
        trainer.train()
    finally:
        trainer.close()
    return losses


def _baseline(
    rank: int, world_size: int, common: list[str], seed: Path, out: Path, module: str = "llama3"
) -> None:
    """torchtitan's own model (its ``module``'s) on one rank, no CP: first the seed checkpoint
    (what ``train.py --checkpoint.create_seed_checkpoint`` does), then training from it."""
    with torchtitan_on_cpu(rank):
        trainer = _build([f"--module={module}", *common, "--checkpoint.create_seed_checkpoint"])
        trainer.checkpointer.save(curr_step=0, last_step=True)
        trainer.close()
        losses = _train(
            [
                f"--module={module}",
                *common,
                f"--checkpoint.initial_load_path={seed}",
                "--checkpoint.folder=baseline",
            ]
        )
    out.write_text(json.dumps(losses))


def _with_plugin(rank: int, world_size: int, common: list[str], seed: Path, out: Path) -> None:
    """On 2 ranks, cp 2, through the plug-in's --config function: the mismatched balancer
    refused (and, with the check disabled, one step of what it would have trained), UPipe with
    torchtitan cutting the sequence (tiled MLP and RMSNorm, torchtitan's selective AC), FPDT laid
    out by the style, ring attention under torchtitan's headtail balancer."""
    from upipe_dtensor.integrations.torchtitan import tt030

    plugin = [
        f"--module={PLUGIN}",
        *common,
        "--parallelism.context_parallel_degree=2",
        f"--checkpoint.initial_load_path={seed}",
    ]
    headtail = ["--parallelism.context_parallel_load_balancer=headtail"]
    runs = {}
    with torchtitan_on_cpu(rank):
        with pytest.raises(ValueError) as refused:
            _build([*plugin, *headtail, "--upipe.heads_per_stage=8"])
        runs["refusal"] = str(refused.value)
        with mock.patch.object(tt030, "check_load_balancer", lambda *_, **__: None):
            runs["unchecked headtail"] = _train(
                [*plugin, *headtail, "--training.steps=1", "--checkpoint.folder=unchecked"]
            )
        runs["upipe"] = _train(
            [
                *plugin,
                "--upipe.heads_per_stage=8",
                "--upipe.tiled_mlp",
                "--upipe.tiled_rms_norm",
                "--checkpoint.folder=upipe",
            ]
        )
        runs["fpdt"] = _train(
            [
                *plugin,
                "--upipe.cp_style=fpdt",
                "--upipe.chunk_tokens=16",
                "--checkpoint.folder=fpdt",
            ]
        )
        runs["ring"] = _train(
            [*plugin, *headtail, "--upipe.cp_style=ring", "--checkpoint.folder=ring"]
        )
    if rank == 0:
        out.write_text(json.dumps(runs))


def _with_plugin_tp(rank: int, world_size: int, common: list[str], seed: Path, out: Path) -> None:
    """On 4 ranks, cp 2 x tp 2: UPipe on each tensor-parallel rank's heads under torchtitan's own
    tensor parallelism (its column-/row-wise weights, sequence-parallel norms, loss parallel),
    with the tiled MLP and RMSNorm on its sharded weights."""
    args = [
        f"--module={PLUGIN}",
        *common,
        "--parallelism.context_parallel_degree=2",
        "--parallelism.tensor_parallel_degree=2",
        f"--checkpoint.initial_load_path={seed}",
        "--upipe.tiled_mlp",
        "--upipe.tiled_rms_norm",
        "--checkpoint.folder=upipe_tp",
    ]
    with torchtitan_on_cpu(rank):
        losses = _train(args)
    if rank == 0:
        out.write_text(json.dumps(losses))


def test_styles_in_torchtitans_trainer_equal_it_without_cp(tmp_path: Path) -> None:
    data = tmp_path / "data"  # the corpus as one .jsonl: torchtitan's loader reads a folder
    data.mkdir()
    shutil.copy(ROOT / "assets" / "corpus" / "stdlib_docs.jsonl", data)
    common = _common_args(data, tmp_path / "dump")
    seed = tmp_path / "dump" / "checkpoint" / "step-0"
    run_on_ranks(1, _baseline, common, seed, tmp_path / "baseline.json")
    baseline = json.loads((tmp_path / "baseline.json").read_text())
    run_on_ranks(2, _with_plugin, common, seed, tmp_path / "plugin.json")
    runs = json.loads((tmp_path / "plugin.json").read_text())
    run_on_ranks(4, _with_plugin_tp, common, seed, tmp_path / "tp.json")
    runs["upipe, cp 2 x tp 2"] = json.loads((tmp_path / "tp.json").read_text())

    refusal = runs.pop("refusal")
    assert "\n" not in refusal
    assert "context_parallel_load_balancer = 'headtail'" in refusal
    assert "--parallelism.context_parallel_load_balancer None" in refusal
    (unchecked,) = runs.pop("unchecked headtail")  # what the refusal prevents: a wrong loss,
    assert unchecked != pytest.approx(baseline[0], rel=1e-5, abs=0)  # which this comparison sees
    assert len(baseline) == STEPS and baseline[-1] < baseline[0]  # it trains
    for name, losses in runs.items():
        assert losses == pytest.approx(baseline, rel=1e-5, abs=0), name


def _documents(rank: int, world_size: int, cases: list[dict]) -> None:
    """torchtitan's Llama3 (two debug-model layers) under its flex BlockMask of per-document
    positions, against the style given the document ids of the same positions; forward only
    (flex has no backward on CPU). Fails on rank 0 with every case that differs."""
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:2]
    for layer in config.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=64)
    torch.manual_seed(0)
    reference = config.build()
    reference.init_weights()
    doc_ids = torch.zeros(2, 64, dtype=torch.int32)
    for row, cuts in enumerate(((1, 10, 40), (33,))):  # a one-token document, one across ranks
        for cut in cuts:
            doc_ids[row, cut:] += 1
    positions = document_positions(doc_ids)
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(
            tokens, positions=positions, attention_masks=reference.get_attention_masks(positions)
        )
        failures = []
        for case in cases:
            model, style = copy.deepcopy(reference), make_style(case | {"seq_len": 64})
            parallelize_module(model, init_device_mesh("cpu", (2,)), {"layers.*.attention": style})
            local = model(
                shard(tokens, rank, 2, style),
                positions=shard(positions, rank, 2, style),
                attention_masks=document_ids_from_positions(positions),
            )
            error = rel_err(gather_sequence(local, style), expected)
            if not error <= 1e-5:
                failures.append(f"{case}: rel err {error:.2e}")
    assert not failures, failures


def test_documents_from_torchtitans_positions_equal_its_flex_mask() -> None:
    run_on_ranks(
        2,
        _documents,
        [
            {"style": "upipe", "u": 8},
            {"style": "ring"},
            {"style": "fpdt", "chunks": 4},
        ],
    )


def test_the_config_functions_are_torchtitans_with_the_upipe_section() -> None:
    """``--module upipe_dtensor.integrations.torchtitan --config llama3_8b`` in torchtitan's own
    ConfigManager: torchtitan's Llama3-8B job as the plug-in's trainer config, the [upipe] keys
    on the command line, the plug-in's defaults; and the style it makes is valid for that model."""
    from torchtitan.config import ConfigManager

    from upipe_dtensor.integrations.torchtitan import UPipeTrainer, make_cp_style

    config = ConfigManager().parse_args(
        [f"--module={PLUGIN}", "--config=llama3_8b", "--upipe.heads_per_stage=16"]
    )
    assert type(config) is UPipeTrainer.Config and type(config)._owner is UPipeTrainer
    assert (config.model_spec.name, config.model_spec.flavor) == ("llama3", "8B")
    assert config.parallelism.context_parallel_load_balancer is None
    assert config.parallelism.spmd_backend == "partial_dtensor"
    attention = config.model_spec.model.layers[0].attention
    style = make_cp_style(attention, config.upipe, 8, config.training.seq_len)
    assert type(style).__name__ == "UPipeAttention" and style.options.heads_per_stage == 16


def test_the_config_functions_docs_name_exist() -> None:
    """Every config function docs/torchtitan.md's 0.3.0 section names (a backticked name of a
    registered family, or a ``--config`` value) is one that torchtitan 0.3.0 registers."""
    from upipe_dtensor.integrations.torchtitan.tt030 import upipe_config_functions

    doc = (ROOT / "docs" / "torchtitan.md").read_text()
    section = doc.split("\n## torchtitan 0.3.0\n")[1].split("\n## ")[0]
    named = set(re.findall(r"`((?:llama3|qwen3)_\w+)`", section))
    named |= set(re.findall(r"--config[ =](\w+)", section)) - {"my_job"}
    assert len(named) >= 8 and "qwen3_8b" not in named
    assert named <= set(upipe_config_functions()), named - set(upipe_config_functions())


def test_other_spmd_backends_are_refused_and_tensor_parallel_heads_checked() -> None:
    """The spmd_types backend is refused with the fix; tensor parallelism is taken, its degree
    checked against the heads before any work (one line naming the key)."""
    from torchtitan.config import ConfigManager

    from upipe_dtensor.integrations.torchtitan import UPipeTrainer, make_cp_style

    config = ConfigManager().parse_args(
        [
            f"--module={PLUGIN}",
            "--config=llama3_debugmodel",
            "--parallelism.context_parallel_degree=2",
            "--parallelism.spmd_backend=spmd_types",
        ]
    )
    with pytest.raises(ValueError, match="spmd_backend = 'spmd_types' shards .* partial_dtensor"):
        UPipeTrainer(config)
    config = ConfigManager().parse_args([f"--module={PLUGIN}", "--config=llama3_8b"])
    attention = config.model_spec.model.layers[0].attention  # 32 query heads, 8 KV heads
    with pytest.raises(ValueError, match=r"^\[upipe\] tensor_parallel_degree = 16 must divide the "
                       r"query heads \(32\) and the KV heads \(8\)[^\n]*dividing 8$"):  # fmt: skip
        make_cp_style(attention, config.upipe, 2, config.training.seq_len, 16)
    make_cp_style(attention, config.upipe, 2, config.training.seq_len, 8)  # 1 KV head per rank


MOE_STEPS = 4


def _moe_runs(rank: int, world_size: int, common: list[str], seed: Path, out: Path) -> None:
    """torchtitan's ``qwen3_moe_debug`` on 2 ranks through the plug-in: UPipe at cp 2 with
    every MoE block tiled (``--upipe.tiled_mlp``), and at cp 2 with its experts over ep 2."""
    plugin = [
        f"--module={PLUGIN}",
        *common,
        "--parallelism.context_parallel_degree=2",
        f"--checkpoint.initial_load_path={seed}",
        "--upipe.heads_per_stage=8",
    ]
    runs = {}
    with torchtitan_on_cpu(rank):
        runs["upipe, tiled MoE"] = _train(
            [*plugin, "--upipe.tiled_mlp", "--checkpoint.folder=upipe"]
        )
        runs["upipe, ep 2"] = _train(
            [
                *plugin,
                "--parallelism.expert_parallel_degree=2",
                "--training.disable_cuda_graphs",
                "--checkpoint.folder=upipe_ep",
            ]
        )
    if rank == 0:
        out.write_text(json.dumps(runs))


def test_the_moe_debug_model_with_upipe_equals_torchtitan_without_cp(tmp_path: Path) -> None:
    """torchtitan's Qwen3-MoE debug model (8 blocks of 64 experts, top 8) trained through the
    plug-in with UPipe, its MoE blocks tiled, and with expert parallelism: torchtitan's own
    losses without CP, step by step."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(ROOT / "assets" / "corpus" / "stdlib_docs.jsonl", data)
    common = _common_args(data, tmp_path / "dump")
    common[0] = "--config=qwen3_moe_debug"
    common[common.index(f"--training.steps={STEPS}")] = f"--training.steps={MOE_STEPS}"
    seed = tmp_path / "dump" / "checkpoint" / "step-0"
    run_on_ranks(1, _baseline, common, seed, tmp_path / "baseline.json", "qwen3")
    baseline = json.loads((tmp_path / "baseline.json").read_text())
    run_on_ranks(2, _moe_runs, common, seed, tmp_path / "plugin.json")
    runs = json.loads((tmp_path / "plugin.json").read_text())
    assert len(baseline) == MOE_STEPS and baseline[-1] < baseline[0]
    for name, losses in runs.items():
        assert losses == pytest.approx(baseline, rel=1e-4, abs=0), (name, losses, baseline)
