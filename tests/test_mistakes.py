"""A user's mistakes, each made through a real entry point (train.py, convert, evaluate, plan) in
this process, and the one clear line it must get: nothing a user owns is lost, bad data is named
by file and line before any process group, impossible budgets are refused in seconds.

Every case here stops before any process group exists (or needs none), so none spawns a launcher;
Ctrl-C and resuming on changed data are in ``test_interrupts.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from upipe_dtensor import convert, evaluate, plan
from upipe_dtensor.checkpointing.model_record import check_model_unchanged, model_record
from upipe_dtensor.checkpointing.weights import save_dcp_weights, unloaded_hf_weights
from upipe_dtensor.commands.evaluate import read_tokens
from upipe_dtensor.config import ConfigError, parse_args
from upipe_dtensor.data.checks import data_changes, data_fingerprint, scan_local_data
from upipe_dtensor.data.loader import (
    HubDocuments,
    LocalDocuments,
    build_tokenizer,
    documents_digest,
)
from upipe_dtensor.models import Llama3
from upipe_dtensor.models.hf_config import args_from_hf, model_args
from upipe_dtensor.planning.checkpoint_interval import suggested_interval
from upipe_dtensor.train.build import check_tokenizer_fits
from upipe_dtensor.train.trainer import _described

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "train_configs/debug_model.toml")
TINY_CONFIG = {  # a Llama small enough to convert in a blink, and not the debug model's shape
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
    "rope_theta": 10000.0,
}


def _train_py():
    spec = importlib.util.spec_from_file_location("train_entry", REPO / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(tmp_path: Path, *extra: str) -> int:
    """train.py in this process, one rank: every case here fails before a process group."""
    return _train_py().main(
        [
            "--config",
            DEBUG,
            "--parallelism.context_parallel_degree",
            "1",
            "--job.dump_folder",
            str(tmp_path / "job"),
            *extra,
        ]
    )


@pytest.fixture
def one_rank(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


# --- --help -------------------------------------------------------------------------------------


def test_help_of_every_entry_point_shows_the_config_and_override_syntax(capsys) -> None:
    assert _train_py().main(["--help"]) == 0
    outputs = {"train.py": capsys.readouterr().out}
    for name, main in (("evaluate", evaluate.main), ("convert", convert.main), ("plan", plan.main)):
        with pytest.raises(SystemExit) as done:
            main(["--help"])
        assert done.value.code == 0
        outputs[name] = capsys.readouterr().out
    for name, text in outputs.items():
        assert "--config" in text and "--section.key value" in text, name
        assert re.search(r"--[a-z_]+\.[a-z_]+ ", text), name  # an example of an override
    for name in ("evaluate", "convert", "plan"):
        assert "--overwrite" in outputs[name], name
    for name, text in outputs.items():
        assert not _wrapped_examples(text), name


def _wrapped_examples(text: str) -> list[str]:
    """Example commands of a --help text that were wrapped without a backslash: a command (and
    its backslash-continued lines) followed by a line at least as indented that is not another
    command, a comment or blank."""
    lines, wrapped = text.splitlines() + [""], []
    for start, line in enumerate(lines):
        if re.match(r"\s+(python|torchrun) ", line):
            end = start
            while lines[end].rstrip().endswith("\\"):
                end += 1
            after = lines[end + 1]
            indent = len(line) - len(line.lstrip())
            if after.strip() and len(after) - len(after.lstrip()) >= indent:
                if not re.match(r"\s+(python|torchrun|#)", after):
                    wrapped.append("\n".join(lines[start : end + 2]))
    return wrapped


def test_the_start_up_line_names_overrides_instead_of_a_contradicted_description() -> None:
    assert _described(parse_args(["--config", DEBUG])) == ": 'debug model, UPipe cp=2'"
    ring = parse_args(["--config", DEBUG, "--parallelism.cp_style", "ring", "--training.steps=9"])
    assert _described(ring) == " with --parallelism.cp_style ring"


# --- values that are not numbers ------------------------------------------------------------------


def test_non_finite_hyperparameters_are_one_line_config_errors(
    tmp_path: Path, capsys, one_rank
) -> None:
    assert _train(tmp_path, "--optimizer.lr", "nan") == 2
    err = capsys.readouterr().err
    assert "config error: command line: [optimizer] lr = nan is not a finite number" in err
    assert "Traceback" not in err
    job = tmp_path / "inf.toml"
    job.write_text(
        f'extends = "{DEBUG}"\n[training]\nmax_norm = inf\n'
        "[parallelism]\ncontext_parallel_degree = 1\n"
    )
    assert _train_py().main(["--config", str(job)]) == 2
    assert f"{job}: [training] max_norm = inf is not a finite number" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        plan.main(["--config", DEBUG, "--device-memory-gib", "nan"])
    assert done.value.code == 2
    assert "--device-memory-gib: nan is not a finite number" in capsys.readouterr().err
    assert not dist.is_initialized()


# --- data -----------------------------------------------------------------------------------------


def _corpus(folder: Path) -> Path:
    """A jsonl corpus with bad records deep inside (lines 13, 27, 31, 34), and a clean .txt."""
    folder.mkdir()
    lines = [json.dumps({"text": f"document {i}: " + "words " * (i % 7 + 1)}) for i in range(36)]
    lines[12] = '{"text": "unterminated'
    lines[26] = json.dumps({"body": "the wrong field"})
    lines[30] = json.dumps({"text": 42})
    lines.insert(33, json.dumps({"text": "   "}))
    (folder / "a.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "b.txt").write_text("plain text\fmore text")
    return folder


def test_bad_records_are_named_before_any_process_group_or_skipped(
    tmp_path: Path, capsys, one_rank
) -> None:
    corpus = _corpus(tmp_path / "corpus")
    began = time.monotonic()
    assert _train(tmp_path, "--training.dataset_path", str(corpus)) == 2
    err = capsys.readouterr().err
    assert (
        f"command line: [training] data: 4 bad records of 39 in dataset_path '{corpus}': "
        f"{corpus}/a.jsonl:13: not valid JSON" in err
    )
    assert f"{corpus}/a.jsonl:27: record has no field 'text' (it has ['body'])" in err
    assert f"{corpus}/a.jsonl:31: the document text is int, not a string; ... (1 more)" in err
    assert "skip_bad_records = true" in err and "Traceback" not in err
    assert not dist.is_initialized() and time.monotonic() - began < 30

    scan = scan_local_data(str(corpus), "text")  # what skipping keeps: every good record, in order
    assert (scan.records, scan.bad_count) == (39, 4)
    kept = list(LocalDocuments(str(corpus), "text", skip_bad=True))
    assert len(kept) == 35 and kept[-2:] == ["plain text", "more text"]
    assert kept[12].startswith("document 13:")


def test_skipping_is_not_offered_when_every_record_is_bad(tmp_path: Path, capsys, one_rank) -> None:
    """Blank records only: skipping them would train on nothing, so the line does not offer it,
    and a job that asks for it anyway is refused the same way."""
    corpus = tmp_path / "blank"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text(json.dumps({"text": "  "}) + "\n" + json.dumps({"text": ""}))
    for skip in ("false", "true"):
        assert (
            _train(
                tmp_path,
                "--training.dataset_path",
                str(corpus),
                "--training.skip_bad_records",
                skip,
            )
            == 2
        )
        err = capsys.readouterr().err
        assert "2 bad records of 2 in dataset_path" in err and "Traceback" not in err
        assert "skip_bad_records = true to train" not in err
        assert (
            f"(every record of dataset_path '{corpus}' is bad, so [training] skip_bad_records = "
            "true would leave nothing of it to train on)" in err
        )


def test_a_token_folder_without_its_manifest_or_with_a_damaged_one_says_so(
    tmp_path: Path, capsys, one_rank
) -> None:
    """Training on a token folder whose tokens.json is missing (a copy cut short), is not JSON
    or lacks a field gets one line naming the manifest, not "holds no .txt files" or a
    KeyError."""
    from upipe_dtensor.data.tokenize import tokenize

    folder = tmp_path / "tokens"
    data = ["--training.dataset_path", str(REPO / "assets/corpus/stdlib_docs_0.txt")]
    tokenize(DEBUG, data, str(folder), workers=1)
    manifest = json.loads((folder / "tokens.json").read_text())
    cases = {
        "": "holds tokens.bin and documents.bin but no tokens.json, the manifest that makes it a "
        "token folder",
        '{"format": "upipe-dtensor token f': "its manifest tokens.json is damaged (not JSON: ",
        json.dumps({k: v for k, v in manifest.items() if k != "dtype"}): "its manifest "
        "tokens.json is damaged: it has no dtype; copy the folder again or tokenize",
    }
    for text, line in cases.items():
        (folder / "tokens.json").unlink(missing_ok=True)
        if text:
            (folder / "tokens.json").write_text(text)
        assert _train(tmp_path, "--training.dataset_path", str(folder)) == 2
        err = capsys.readouterr().err
        assert f"dataset_path '{folder}'" in err and line in err, err
        assert "Traceback" not in err and "holds no .txt" not in err


def test_the_errors_once_lost_under_torchrun_end_as_config_errors(tmp_path, capsys) -> None:
    """The three mistakes whose line torchrun once cut off (issue 38) end through ``run_main``,
    whose printing under torchrun test_faults.py checks with rank 0 starting late."""
    tokens = tmp_path / "floats.npy"
    np.save(tokens, np.zeros((2, 64), dtype=np.float32))
    assert _train(tmp_path, "--metrics.log_freq", "0") == 2
    assert _train(tmp_path, "--model.flavor", "hf") == 2
    one = ["--config", DEBUG, "--parallelism.context_parallel_degree", "1"]
    assert evaluate.main([*one, "--tokens", str(tokens)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "config error: command line: [metrics] log_freq = 0 must be >= 1",
        "config error: command line and train_configs/debug_model.toml: [model] flavor = 'hf' "
        "takes the shape from config.json; set [model] hf_assets_path to the Hugging Face model "
        "folder",
        f"config error: --tokens {tokens}: dtype float32; token ids must be integers",
    ]


def test_unreadable_or_non_utf8_config_files_are_config_errors(
    tmp_path: Path, capsys, monkeypatch, one_rank
) -> None:
    utf16 = tmp_path / "windows.toml"
    utf16.write_text(f'extends = "{DEBUG}"\n', encoding="utf-16")
    assert _train_py().main(["--config", str(utf16)]) == 2
    err = capsys.readouterr().err
    assert (
        f"config error: config file {utf16} is UTF-16 text, but TOML is UTF-8: save it as " in err
    )
    assert "iconv -f UTF-16 -t UTF-8 windows.toml" in err and "Traceback" not in err
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(f'extends = "{DEBUG}"\n[job]\ndescription = "caf\xe9"\n'.encode("latin-1"))
    assert _train_py().main(["--config", str(latin1)]) == 2
    assert "is not UTF-8 text (byte " in capsys.readouterr().err

    real_read = Path.read_bytes

    def unreadable(path: Path) -> bytes:  # chmod 000 does not stop root, which runs CI here
        if path.name == "locked.toml":
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(path)

    locked = tmp_path / "locked.toml"
    locked.write_text(f'extends = "{DEBUG}"\n')
    monkeypatch.setattr(Path, "read_bytes", unreadable)
    assert _train_py().main(["--config", str(locked)]) == 2
    assert (
        f"config error: config file {locked} cannot be read (Permission denied); fix its "
        "permissions or pass another --config" in capsys.readouterr().err
    )
    assert not dist.is_initialized()


def test_a_tokenizer_of_another_vocabulary_is_refused(tmp_path: Path, capsys) -> None:
    """Issue 38: a model trained with a tokenizer smaller than its vocabulary was accepted without
    a word (the recipes' 2,048-token stand-in for Llama3-8B's 128,256), and a larger one fails
    only where an id runs past the embedding. train.py refuses both before any process group,
    naming the key; padding (Qwen3: 267 rows beyond its tokens) passes."""
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps({**TINY_CONFIG, "vocab_size": 128256}))
    assert _train(tmp_path, "--model.flavor", "hf", "--model.hf_assets_path", str(big)) == 2
    assert capsys.readouterr().err.startswith(
        "config error: train_configs/debug_model.toml and command line: [model] tokenizer_path: "
        "the tokenizer at 'assets/tokenizer' has 2,048 tokens, but llama3 hf has 128,256 "
        "embedding rows: 126,208 would never be trained (padding is under 1,024). Point [model] "
        "tokenizer_path at the model's own tokenizer"
    )
    config = parse_args(["--config", DEBUG])
    args = model_args(config.model, 512)  # 2,048 rows
    for tokens, refused in ((2049, True), (2048 - 267, False), (1024, True)):
        tokenizer = SimpleNamespace(vocab_size=tokens)
        if refused:
            with pytest.raises(ConfigError, match=f"has {tokens:,} tokens, "):
                check_tokenizer_fits(config, tokenizer, args, exact=True)
        else:
            check_tokenizer_fits(config, tokenizer, args, exact=True)
    check_tokenizer_fits(config, SimpleNamespace(vocab_size=1024), args, exact=False)  # planner


def test_hf_weights_beside_a_job_that_would_not_load_them_are_named(
    tmp_path: Path, capsys, weights, one_rank
) -> None:
    hf = ["--model.flavor", "hf", "--model.hf_assets_path", str(weights["hf"])]
    assert _train(tmp_path, *hf) == 2
    assert (
        f"command line: [model] hf_assets_path = '{weights['hf']}' holds Hugging Face weights (1 "
        "*.safetensors file), but this job would start from seed 0 initial weights: set "
        "[checkpoint] initial_load_in_hf = true to start from those weights, or "
        "initial_load_in_hf = false to train from the seed on purpose" in capsys.readouterr().err
    )
    assert not dist.is_initialized()
    config = parse_args(["--config", DEBUG, *hf, "--checkpoint.initial_load_in_hf", "false"])
    assert unloaded_hf_weights(config) == ""  # the seed's weights, written down: no question
    assert unloaded_hf_weights(parse_args(["--config", DEBUG])) == ""


def test_model_settings_are_compared_key_by_key_and_old_snapshots_pass(
    tmp_path: Path, caplog
) -> None:
    """A snapshot's manifest records its model; resume, convert and evaluate compare it (their
    refusals through the real commands: tests/test_evaluate.py)."""
    config = parse_args(["--config", DEBUG])
    args = model_args(config.model, 512)
    old, new = tmp_path / "step-1", tmp_path / "step-2"
    for snapshot in (old, new):
        snapshot.mkdir()
    (old / "manifest.json").write_text(json.dumps({"format": 1, "files": {}}))  # no record
    check_model_unchanged(old, config, args, rank0=True)
    heads = {**model_record(config, args), "num_attention_heads": 2, "head_dim": 128}
    (new / "manifest.json").write_text(json.dumps({"format": 1, "model": heads, "files": {}}))
    with pytest.raises(ConfigError) as refused:  # same tensor shapes, another head layout
        check_model_unchanged(new, config, args, rank0=True)
    assert (
        "was trained with other model settings: num_attention_heads = 2 there, 8 in this job; "
        "head_dim = 128 there, 32 in this job. Changing num_attention_heads, head_dim makes "
        "another model, which [checkpoint] accept_model_change does not allow (it lets only RoPE "
        "settings change: rope_theta, rope_scaling.factor, " in str(refused.value)
    )

    # accept_model_change (issue 38) lets RoPE change, with a warning; a family or a head layout
    # stays refused: a Qwen3 snapshot would load into Llama3 without its QK-norm weights.
    accept = parse_args(["--config", DEBUG, "--checkpoint.accept_model_change", "true"])
    rope = {**model_record(config, args), "rope_theta": 10000.0}
    for record in (heads, {**model_record(config, args), "name": "qwen3"}, rope):
        (new / "manifest.json").write_text(json.dumps({"format": 1, "model": record, "files": {}}))
        if record is rope:
            check_model_unchanged(new, accept, args, rank0=True)
        else:
            with pytest.raises(ConfigError, match="does not allow"):
                check_model_unchanged(new, accept, args, rank0=True)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            f"snapshot {new} was trained with other model settings: rope_theta = 10000.0 there, "
            "500000.0 in this job; using this job's ([checkpoint] accept_model_change = true)",
        )
    ]


def test_the_token_file_recipe_makes_what_evaluate_reads(tmp_path: Path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("tokens", REPO / "scripts/make_eval_tokens.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "eval.npy"
    corpus = str(REPO / "assets/corpus")
    tokenizer = str(REPO / "assets/tokenizer")
    args = [corpus, str(out), "--rows", "3", "--seq-len", "256", "--tokenizer", tokenizer]
    assert script.main(args) == 0
    tokens = read_tokens(str(out))  # what evaluate --tokens accepts
    assert tokens.shape == (3, 256) and tokens[0, 0] == build_tokenizer(tokenizer).bos_id
    assert 0 <= tokens.min() and tokens.max() < 2048
    too_long = [corpus, str(tmp_path / "long.npy"), "--rows", "4", "--seq-len", "100000"]
    assert script.main([*too_long, "--tokenizer", tokenizer]) == 2
    assert "holds 2 window(s) of 100,000 tokens, fewer than --rows 4" in capsys.readouterr().err


def test_changed_data_is_described(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "corpus")
    documents = LocalDocuments(str(corpus), "text", skip_bad=True)
    scan = scan_local_data(str(corpus), "text")
    count, digest = documents_digest(documents, 20)
    saved = {
        **data_fingerprint(documents.description, scan.files),
        "read": {"0": {"epoch": 0, "documents": count, "sha256": digest}},
    }
    now = data_fingerprint(documents.description, scan.files)
    assert data_changes(saved, now, 0, documents) == ""
    for path in corpus.iterdir():  # copied without preserving times, or touched: not a change
        os.utime(path, ns=(1, 1))
    touched = data_fingerprint(documents.description, scan_local_data(str(corpus), "text").files)
    assert data_changes(saved, touched, 0, documents) == ""
    old_format = {**saved, "files": {name: [size, 0] for name, (size, _) in scan.files.items()}}
    assert data_changes(old_format, touched, 0, documents) == ""  # [size, mtime] snapshots
    (corpus / "c.txt").write_text("appended later")
    grown = data_fingerprint(documents.description, scan_local_data(str(corpus), "text").files)
    assert data_changes(saved, grown, 0, LocalDocuments(str(corpus), "text", skip_bad=True)) == (
        "1 file added (c.txt); the 20 documents read so far are unchanged, so resuming would go "
        "on from the same point, but through the data as it is now"
    )
    lines = (corpus / "a.jsonl").read_text().splitlines()
    (corpus / "a.jsonl").write_text("\n".join(lines[10:]) + "\n")  # ten documents removed
    fewer = scan_local_data(str(corpus), "text")
    shrunk = data_fingerprint(documents.description, fewer.files)
    changes = data_changes(saved, shrunk, 0, LocalDocuments(str(corpus), "text", skip_bad=True))
    assert changes.startswith("1 file added (c.txt); 1 file changed (a.jsonl); ")
    assert changes.endswith(
        "the 20 documents read before the snapshot differ, so the saved position now points "
        "elsewhere: resuming would skip or repeat documents"
    )


def test_an_unreachable_hub_dataset_fails_in_seconds_naming_the_offline_switch(
    tmp_path: Path, capsys, monkeypatch, one_rank
) -> None:
    def no_network(*args, **kwargs):
        raise OSError("Network is unreachable")

    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(socket, "create_connection", no_network)
    began = time.monotonic()
    assert _train(tmp_path, "--training.dataset", "org/some-corpus") == 2
    err = capsys.readouterr().err
    assert "Hugging Face dataset 'org/some-corpus' cannot be streamed: cannot reach" in err
    assert "HF_DATASETS_OFFLINE=1" in err and "dataset = 'local'" in err
    assert time.monotonic() - began < 30 and not dist.is_initialized()

    import datasets

    def offline(name, config_name, *, split, streaming):  # what datasets raises at once offline
        raise ConnectionError(f"Couldn't reach {name!r} on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # offline: no probe, datasets answers
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match="'org/some-corpus' cannot be streamed: ConnectionError"):
        HubDocuments("org/some-corpus", "train", "text")


# --- convert: weights in and out -----------------------------------------------------------------


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama as a model-only DCP checkpoint and as a Hugging Face folder."""
    root = tmp_path_factory.mktemp("weights")
    assets = root / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps(TINY_CONFIG))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "assets/tokenizer" / name, assets / name)
    with torch.device("meta"):
        model = Llama3(args_from_hf(TINY_CONFIG, "tiny"))
    model.to_empty(device="cpu")
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.02)
    save_dcp_weights(model, str(root / "dcp"))
    shape = ["--model.flavor", "hf", "--model.hf_assets_path", str(assets)]
    assert convert.main(["--to", "hf", str(root / "dcp"), str(root / "hf"), *shape]) == 0
    return {"dcp": root / "dcp", "hf": root / "hf", "assets": assets}


def test_convert_never_removes_what_it_did_not_write(tmp_path: Path, weights, capsys) -> None:
    target = tmp_path / "job"  # a dump folder a user converts into by mistake
    (target / "checkpoint").mkdir(parents=True)
    (target / "checkpoint" / "step-30").mkdir()
    (target / "loss_by_position.png").write_bytes(b"a plot")
    (target / "config.json").write_text("{}")
    before = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}
    shape = ["--model.flavor", "hf", "--model.hf_assets_path", str(weights["assets"])]
    args = ["--to", "hf", str(weights["dcp"]), str(target), *shape]

    assert convert.main(args) == 2
    err = capsys.readouterr().err
    assert (
        f"{target} is not empty: it holds 3 entries (checkpoint, config.json, "
        "loss_by_position.png); pass --overwrite" in err
    )
    assert {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} == before

    assert convert.main([*args, "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert "kept 2 entries (checkpoint, loss_by_position.png) that convert did not write" in out
    assert (target / "checkpoint" / "step-30").is_dir()
    assert (target / "loss_by_position.png").read_bytes() == b"a plot"
    shard = "model-00001-of-00001.safetensors"
    assert (target / shard).read_bytes() == (weights["hf"] / shard).read_bytes()
    assert json.loads((target / "config.json").read_text())["hidden_size"] == 64  # replaced
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_convert_with_another_models_config_names_the_weight(
    tmp_path: Path, weights, capsys
) -> None:
    args = ["--to", "hf", str(weights["dcp"]), str(tmp_path / "out"), "--config", DEBUG]
    assert convert.main(args) == 2
    err = capsys.readouterr().err
    assert (
        f"config error: the weights in {weights['dcp']} are not this model's: "
        "tok_embeddings.weight is (2048, 64) there, (2048, 256) in this model (and" in err
    )
    assert "pass the job config (and any --section.key overrides) they were saved with" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_a_truncated_safetensors_file_is_named(tmp_path: Path, weights, capsys, one_rank) -> None:
    damaged = tmp_path / "hf"
    shutil.copytree(weights["hf"], damaged)
    (shard,) = damaged.glob("*.safetensors")
    size = shard.stat().st_size
    with shard.open("r+b") as handle:
        handle.truncate(size // 2)
    assert convert.main(["--to", "dcp", str(damaged), str(tmp_path / "dcp")]) == 2
    message = f"{shard} is truncated: {size // 2:,} bytes, its header describes {size:,}"
    assert message in capsys.readouterr().err
    hf_job = ["--model.flavor", "hf", "--model.hf_assets_path", str(damaged)]
    assert _train(tmp_path, *hf_job, "--checkpoint.initial_load_in_hf", "true") == 2
    assert message in capsys.readouterr().err and not dist.is_initialized()


def test_training_refuses_to_export_over_an_earlier_export(
    tmp_path: Path, capsys, one_rank
) -> None:
    export = tmp_path / "job" / "checkpoint" / "step-60-hf"
    export.mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"someone's weights")
    assert _train(tmp_path, "--checkpoint.last_save_in_hf", "true") == 2
    assert (
        f"{export} is not empty: it holds 1 entry (model.safetensors); the Hugging Face export "
        "after the last step goes there" in capsys.readouterr().err
    )
    assert (export / "model.safetensors").read_bytes() == b"someone's weights"


# --- the planner ----------------------------------------------------------------------------------


def test_planner_answers_what_cannot_fit_in_seconds_with_its_own_exit_code(
    tmp_path: Path, capsys
) -> None:
    """ "Nothing can fit" is the planner's answer, exit 3 (docs/troubleshooting.md), not a config
    error (2)."""
    began = time.monotonic()
    assert plan.main(["--config", DEBUG, "--max-context", "--device-memory-gib", "1"]) == 3
    err = capsys.readouterr().err
    assert err.startswith(
        "nothing can fit: with FSDP CPU offload: each GPU needs 2.56 GiB before any "
        "activation (CUDA context 1.00, NCCL buffers (3 communicators) 1.50, cuBLAS workspace "
        "0.06 GiB), more than its 1 GiB | without FSDP CPU offload:"
    )
    sweep = ["--sweep", "seq_len", "--out", str(tmp_path), "--device-memory-gib", "2"]
    assert plan.main(["--config", DEBUG, *sweep]) == 3
    assert capsys.readouterr().err.startswith("nothing can fit: without FSDP CPU offload")
    assert time.monotonic() - began < 60  # a search plans for minutes; this plans nothing
    assert not list(tmp_path.iterdir())


def test_planner_says_which_memory_does_not_fit_and_keeps_old_sweeps(
    tmp_path: Path, capsys
) -> None:
    """A plan that does not fit prints its whole report, then says so on stderr with exit 3
    (the JSON too); a plan that fits exits 0."""
    offload = ["--training.enable_cpu_offload", "true", "--host-memory-gib", "1e-6"]
    assert plan.main(["--config", DEBUG, "--json", *offload]) == 3
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert err.startswith(f"{DEBUG}: does not fit (host memory): ") and err.count("\n") == 1
    assert (report["fits"], report["fits_device"], report["fits_host"]) == (False, True, False)
    assert report["checkpoint_interval"] == suggested_interval(report["step_time_s"])
    assert report["host_holds"] == "activation offload, FSDP CPU offload"  # only when it is on
    assert report["exceeds"] == "host memory"
    assert plan.main(["--config", DEBUG, "--device-memory-gib", "0.01"]) == 3
    out, err = capsys.readouterr()
    assert "fits: NO (device memory)" in out and "does not fit (device memory): " in err
    assert plan.main(["--config", DEBUG]) == 0
    assert "fits: yes" in capsys.readouterr().out
    (tmp_path / "sweep.csv").write_text("an earlier sweep")
    assert plan.main(["--config", DEBUG, "--sweep", "seq_len", "--out", str(tmp_path)]) == 2
    assert f"{tmp_path / 'sweep.csv'} already exists; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "sweep.csv").read_text() == "an earlier sweep"
