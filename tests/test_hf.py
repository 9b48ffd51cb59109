"""Hugging Face in and out, against ``transformers`` itself: a tiny HF Llama loaded on 2 gloo
ranks with UPipe gives transformers' logits; evaluate reports transformers' loss; HF -> our
checkpoint -> HF is bit-exact; the trainer's HF export loads in transformers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from harness import gather_sequence, rel_err, run_command, run_on_ranks
from hf_tiny import SEQ_LEN, load_reference, random_tokens, safetensors_weights, write_tiny_hf_llama
from torch.distributed.checkpoint import HuggingFaceStorageReader

from upipe_dtensor import convert
from upipe_dtensor.commands.evaluate import position_loss_sums
from upipe_dtensor.config import ConfigError, check_job, parse_args
from upipe_dtensor.train.build import build_parallel_model, load_initial_weights

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    return write_tiny_hf_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")


def _job(dump: Path, hf: Path, *extra: str):
    return parse_args(
        [
            "--config",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            str(dump),
            "--model.flavor",
            "hf",
            "--model.hf_assets_path",
            str(hf),
            "--model.tokenizer_path=",
            "--checkpoint.initial_load_in_hf",
            "true",
            "--training.seq_len",
            str(SEQ_LEN),
            "--parallelism.context_parallel_degree",
            "2",
            "--metrics.enable_tensorboard",
            "false",
            *extra,
        ]
    )


def _elements_read(counter: list[int]):
    """Wrap the HF reader so it counts the tensor elements this rank reads from safetensors."""
    read_data = HuggingFaceStorageReader.read_data

    def counting(self, plan, planner):
        counter[0] += sum(int(np.prod(item.lengths)) for item in plan.items)
        return read_data(self, plan, planner)

    HuggingFaceStorageReader.read_data = counting


def _logits_on_ranks(rank: int, world: int, dump: str, cases: list, tokens, packed) -> None:
    _document_losses(Path(dump), *packed)
    for hf, expected, tied in cases:
        read = [0]
        _elements_read(read)
        built = build_parallel_model(_job(Path(dump), Path(hf), "--checkpoint.enable", "false"))
        load_initial_weights(built)
        total = sum(p.numel() for p in built.model.parameters())
        # Each rank read only its own shards from the files: half the model, and together all of
        # it (tied embeddings: the output layer is a copy, read once).
        reads = [None] * world
        dist.all_gather_object(reads, read[0])
        stored = total - (built.model.output.weight.numel() if tied else 0)
        assert sum(reads) == stored and max(reads) <= stored // world + 2048, (reads, stored)
        with torch.no_grad():
            logits = gather_sequence(built(built.shard_sequence(tokens)))
        assert logits.shape == expected.shape
        err = rel_err(logits, expected)
        assert err <= 1e-4, err
        if rank == 0:
            print(
                f"UPipe cp=2 logits vs transformers ({'tied' if tied else 'untied'}): rel err "
                f"{err:.2e}"
            )


def _document_losses(dump: Path, hf: str, row: torch.Tensor, expected: torch.Tensor) -> None:
    """evaluate's per-position losses of a packed row, document-masked, equal transformers'
    losses of each document run on its own."""
    built = build_parallel_model(
        _job(
            dump,
            Path(hf),
            "--checkpoint.enable",
            "false",
            "--training.attention_mask",
            "document",
            "--training.position_ids",
            "document",
        )
    )
    load_initial_weights(built)
    losses = position_loss_sums(built, row)[:-1]
    err = rel_err(losses, expected)
    assert err <= 1e-4, err
    if dist.get_rank() == 0:
        print(f"document-masked per-token losses vs transformers per document: rel err {err:.2e}")


def test_logits_equal_transformers(tmp_path: Path, hf_folder: Path) -> None:
    """Also for tied embeddings (Llama 3.2 1B/3B store no lm_head), and for a packed row of two
    documents (the first ends with EOS) with document masking and positions."""
    tied = write_tiny_hf_llama(tmp_path / "tied", seed=3, tie_word_embeddings=True)
    assert "lm_head.weight" not in safetensors_weights(tied)
    tokens = random_tokens(2)
    cases = []
    for folder, is_tied in ((hf_folder, False), (tied, True)):
        with torch.no_grad():
            cases.append((str(folder), load_reference(folder)(tokens).logits, is_tied))
    first, second = random_tokens(1, 20, seed=4)[0], random_tokens(1, SEQ_LEN - 20, seed=5)[0]
    first[-1] = 1  # the tiny model's (and the shipped tokenizer's) EOS: the boundary
    row = torch.cat([first, second])[None]
    with torch.no_grad():
        reference = load_reference(hf_folder)
        logits = torch.cat([reference(first[None]).logits[0], reference(second[None]).logits[0]])
    expected = torch.nn.functional.cross_entropy(logits[:-1], row[0, 1:], reduction="none")
    run_on_ranks(2, _logits_on_ranks, str(tmp_path), cases, tokens, (str(hf_folder), row, expected))


def test_evaluate_under_torchrun_reports_transformers_loss(tmp_path: Path, hf_folder: Path) -> None:
    tokens = random_tokens(3, seed=2)
    np.save(tmp_path / "tokens.npy", tokens.numpy().astype(np.int32))
    with torch.no_grad():
        expected = load_reference(hf_folder)(
            tokens, labels=tokens
        ).loss.item()  # transformers' own shift
    job = tmp_path / "eval.toml"
    job.write_text(
        f'extends = "{REPO / "train_configs/debug_model.toml"}"\n'
        f'[job]\ndump_folder = "{tmp_path / "out"}"\n'
        f'[model]\nflavor = "hf"\nhf_assets_path = "{hf_folder}"\ntokenizer_path = ""\n'
        f"[checkpoint]\ninitial_load_in_hf = true\n"
        f"[metrics]\nenable_tensorboard = false\n"
    )
    returncode, stdout, stderr = run_command(
        "-m",
        "upipe_dtensor.evaluate",
        "--config",
        str(job),
        "--tokens",
        str(tmp_path / "tokens.npy"),
        processes=2,
    )
    assert returncode == 0, stderr[-3000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["predicted_tokens"] == 3 * (SEQ_LEN - 1)
    assert abs(report["loss"] - expected) <= 1e-5 * expected, (report["loss"], expected)
    print(f"evaluate loss {report['loss']:.7f} vs transformers {expected:.7f}")
    assert list(report["loss_by_position"]) == ["0", "1", "2-3", "4-7", "8-15", "16-31", "32-62"]
    weights = [1, 1, 2, 4, 8, 16, 31]  # positions per bucket: the buckets average back to the loss
    mean = sum(w * v for w, v in zip(weights, report["loss_by_position"].values())) / (SEQ_LEN - 1)
    assert abs(mean - report["loss"]) <= 1e-6 * report["loss"]
    assert (tmp_path / "out" / "loss_by_position_tokens_hf_causal.png").stat().st_size > 0


def test_hf_to_dcp_to_hf_is_bit_exact(tmp_path: Path, hf_folder: Path) -> None:
    assert convert.main(["--to", "dcp", str(hf_folder), str(tmp_path / "dcp")]) == 0
    assert (
        convert.main(
            [
                "--to",
                "hf",
                str(tmp_path / "dcp"),
                str(tmp_path / "hf"),
                "--model.flavor",
                "hf",
                "--model.hf_assets_path",
                str(hf_folder),
            ]
        )
        == 0
    )
    original, back = safetensors_weights(hf_folder), safetensors_weights(tmp_path / "hf")
    assert sorted(back) == sorted(original)
    for name, weight in original.items():
        assert back[name].dtype == weight.dtype and torch.equal(back[name], weight), name
    tokens = random_tokens(1)
    with torch.no_grad():
        assert torch.equal(
            load_reference(tmp_path / "hf")(tokens).logits, load_reference(hf_folder)(tokens).logits
        )


def test_the_exported_config_loads_in_transformers_without_a_warning() -> None:
    """Issue 38: the debug job's export said max_position_embeddings = 512 (its seq_len), below
    its RoPE scaling's original_max_position_embeddings = 8192, and transformers warned on load."""
    import logging

    import transformers

    from upipe_dtensor.models.hf_config import hf_config_for, model_args

    config = parse_args(["--config", str(REPO / "train_configs/debug_model.toml")])
    exported = hf_config_for(model_args(config.model, config.training.seq_len))
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        transformers.LlamaConfig(**exported)
    finally:
        logger.removeHandler(handler)
    assert warnings == []
    assert exported["max_position_embeddings"] == 8192 * 8  # the reach of Llama 3.1's scaling


def test_flavor_disagreeing_with_config_json_is_a_config_error(
    tmp_path: Path, hf_folder: Path
) -> None:
    config = _job(tmp_path, hf_folder, "--model.flavor", "debugmodel")
    with pytest.raises(
        ConfigError, match=r"flavor = 'debugmodel' has hidden_size = 256, but .*config.json has 64"
    ):
        check_job(config, world_size=2)
    with pytest.raises(
        ConfigError,
        match=r"flavor = 'hf' takes the shape from config.json; set \[model\] hf_assets_path",
    ):
        check_job(_job(tmp_path, hf_folder, "--model.hf_assets_path="), world_size=2)


def _train_on_ranks(rank: int, world: int, dump: str, hf: str, out: str) -> None:
    from upipe_dtensor.train.trainer import Trainer

    trainer = Trainer(
        _job(
            Path(dump),
            Path(hf),
            "--training.steps",
            "1",
            "--checkpoint.enable",
            "true",
            "--checkpoint.last_save_in_hf",
            "true",
            "--training.local_batch_size",
            "2",
        )
    )
    losses = trainer.train()
    if rank == 0:
        Path(out).write_text(json.dumps(losses))


def test_trainer_starts_from_hf_and_exports_hf(tmp_path: Path, hf_folder: Path) -> None:
    """Step 1's loss is transformers' loss on the same batch; the step-1 export (written from the
    2-rank sharded model) equals the single-process conversion of the step-1 snapshot bit for bit,
    differs from the start (training happened), and transformers loads it."""
    from upipe_dtensor.data.loader import PackedTextLoader, build_tokenizer
    from upipe_dtensor.models import IGNORE_INDEX

    run_on_ranks(
        2, _train_on_ranks, str(tmp_path / "job"), str(hf_folder), str(tmp_path / "losses.json")
    )
    loss = json.loads((tmp_path / "losses.json").read_text())[0]
    loader = PackedTextLoader(
        dataset="local",
        dataset_path=str(REPO / "assets/corpus"),
        text_field="text",
        tokenizer=build_tokenizer(str(hf_folder)),
        seq_len=SEQ_LEN,
        batch_size=2,
        dp_rank=0,
        dp_world_size=1,
    )
    inputs, labels = next(iter(loader))
    with torch.no_grad():
        logits = load_reference(hf_folder)(inputs).logits
    expected = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
    )
    assert abs(loss - expected.item()) <= 1e-5 * expected.item(), (loss, expected.item())
    print(f"step-1 loss from HF weights {loss:.7f} vs transformers {expected.item():.7f}")

    checkpoints = tmp_path / "job" / "checkpoint"
    assert (
        convert.main(
            [
                "--to",
                "hf",
                str(checkpoints / "step-1"),
                str(tmp_path / "converted"),
                "--model.flavor",
                "hf",
                "--model.hf_assets_path",
                str(hf_folder),
            ]
        )
        == 0
    )
    exported, converted = (
        safetensors_weights(checkpoints / "step-1-hf"),
        safetensors_weights(tmp_path / "converted"),
    )
    original = safetensors_weights(hf_folder)
    assert sorted(exported) == sorted(converted) == sorted(original)
    assert all(torch.equal(exported[k], converted[k]) for k in exported)
    assert not any(torch.equal(exported[k], original[k]) for k in exported if "norm" not in k)
    tokens = random_tokens(1)
    with torch.no_grad():
        assert torch.isfinite(load_reference(checkpoints / "step-1-hf")(tokens).logits).all()


def test_initial_load_and_evaluate_inputs_fail_early_with_the_fix(
    tmp_path: Path, hf_folder: Path, capsys
) -> None:
    """Before any process group: each problem is named with the key and what to do."""
    from upipe_dtensor import evaluate

    cases = [
        (
            ["--checkpoint.initial_load_path", str(tmp_path / "none")],
            r"initial_load_path = .* is not a folder",
        ),
        (
            [
                "--checkpoint.initial_load_path",
                str(tmp_path),
                "--checkpoint.initial_load_in_hf",
                "false",
            ],
            r"is not a DCP checkpoint \(no .metadata\); for a Hugging Face folder set "
            r"initial_load_in_hf",
        ),
        (["--checkpoint.initial_load_path", str(tmp_path)], r"holds no \*.safetensors"),
        (
            [
                "--model.flavor",
                "debugmodel",
                "--model.hf_assets_path=",
                "--model.tokenizer_path",
                str(REPO / "assets/tokenizer"),
                "--checkpoint.initial_load_path",
                str(hf_folder),
            ],
            r"the model to train and the weights in .*config.json differ: hidden_size = 256 "
            r"\(model\) vs 64",
        ),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message):
            check_job(_job(tmp_path, hf_folder, *extra), world_size=2)

    job = tmp_path / "job.toml"
    job.write_text(
        f'extends = "{REPO / "train_configs/debug_model.toml"}"\n'
        f'[job]\ndump_folder = "{tmp_path / "empty"}"\n'
    )
    for array, message in [
        (np.zeros((2, 63), np.int64), "cannot be split over context_parallel_degree = 2"),
        (np.zeros(64, np.int64), r"expected \(N, S\)"),
        (np.full((1, 64), 5000), r"outside the model's vocabulary \[0, 2048\)"),
        (np.zeros((1, 64), np.int64), "no weights to evaluate"),
    ]:
        np.save(tmp_path / "t.npy", array)
        assert evaluate.main(["--config", str(job), "--tokens", str(tmp_path / "t.npy")]) == 2
        assert re.search(message, capsys.readouterr().err), message
        assert not dist.is_initialized()
