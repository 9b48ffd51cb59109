"""Document-masked packing in the trainer and the planner: with [training] position_ids /
attention_mask = "document", cp = 2 reproduces cp = 1 on sequences packed from short documents
(2 or 3 documents in each 64-token sequence, documents spanning both CP shards); the options
change the losses (they are not ignored); the planner counts the boundary metadata."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import run_on_ranks

from upipe_dtensor.config import parse_args
from upipe_dtensor.planning.step import CudaAllowances, document_metadata_bytes, plan_job

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
OPTIONS = {
    "causal": [],
    "document positions": ["--training.position_ids", "document"],
    "document mask": [
        "--training.attention_mask",
        "document",
        "--training.position_ids",
        "document",
    ],
    "document mask, global positions": ["--training.attention_mask", "document"],
}


def _short_documents(folder: Path) -> str:
    """60 documents of 1..23 words: a 64-token sequence holds 2 or 3 of them."""
    lines = [
        json.dumps({"text": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + (7 * i) % 23))})
        for i in range(60)
    ]
    path = folder / "short_docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _config(dump: Path, cp: int, corpus: str, extra: list[str]):
    return parse_args(
        [
            "--config",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            str(dump),
            "--training.dataset_path",
            corpus,
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "3",
            "--lr_scheduler.warmup_steps",
            "2",
            "--parallelism.context_parallel_degree",
            str(cp),
            "--checkpoint.enable",
            "false",
            "--metrics.enable_tensorboard",
            "false",
            "--metrics.log_freq",
            "100",
            *extra,
        ]
    )


def _train_each(rank: int, world: int, tmp: str, corpus: str, options: dict, out: str) -> None:
    from upipe_dtensor.train.trainer import Trainer

    losses = {
        name: Trainer(_config(Path(tmp) / name, world, corpus, extra)).train()
        for name, extra in options.items()
    }
    if rank == 0:
        Path(out).write_text(json.dumps(losses))


def test_documents_cp2_equal_cp1(tmp_path: Path) -> None:
    corpus = _short_documents(tmp_path)
    results = {}
    for cp, options in ((1, OPTIONS), (2, {k: v for k, v in OPTIONS.items() if k != "causal"})):
        out = tmp_path / f"cp{cp}.json"
        run_on_ranks(cp, _train_each, str(tmp_path / f"cp{cp}"), corpus, options, str(out))
        results[cp] = json.loads(out.read_text())
    for name in results[2]:
        for step, (one, two) in enumerate(zip(results[1][name], results[2][name]), 1):
            assert abs(one - two) <= 1e-5 * abs(one), f"{name}, step {step}: cp1 {one} vs cp2 {two}"
        assert results[1][name] != pytest.approx(results[1]["causal"], rel=1e-4), name
    # Inside a document RoPE sees only distances, so where positions restart does not matter.
    assert results[1]["document mask, global positions"] == pytest.approx(
        results[1]["document mask"], rel=1e-5
    )
    assert results[1]["document mask"] != pytest.approx(results[1]["document positions"], rel=1e-4)


def test_planner_counts_document_metadata(tmp_path: Path) -> None:
    """The planned peak grows by exactly the boundary metadata, a negligible share of it."""
    plans = {}
    for name, extra in OPTIONS.items():
        config = _config(
            tmp_path,
            2,
            str(REPO / "assets/corpus"),
            ["--training.seq_len", "16384", "--training.local_batch_size", "1", *extra],
        )
        # Without the fragmentation allowance (a share of the peak) the growth is the metadata
        # alone.
        plans[name] = (config, plan_job(config, allowances=CudaAllowances(fragmentation=0.0)))
    causal = plans.pop("causal")[1]
    assert causal.document_metadata_bytes == 0
    # int64 shard positions on the device; the int32 ids of the sequence stay in host memory.
    positions = 16384 // 2 * 8
    expected = {
        "document positions": positions,
        "document mask": positions,
        "document mask, global positions": 0,
    }
    for name, (config, plan) in plans.items():
        assert plan.document_metadata_bytes == document_metadata_bytes(config) == expected[name]
        growth = plan.device_peak_bytes - causal.device_peak_bytes
        assert abs(growth - expected[name]) <= 1024, (name, growth, expected[name])
        assert expected[name] < 1e-3 * causal.device_peak_bytes
        assert ("document metadata" in plan.render()) == bool(expected[name])
