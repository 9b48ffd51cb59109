"""The worked run of docs/training.md (Llama-3.1-8B, the user's data, 1M tokens on 8 GPUs), its
commands in order at the debug scale on CPU: a tiny Hugging Face Llama written by transformers
stands for Llama-3.1-8B, generated .jsonl and .parquet files for the user's data, and the doc's
job file at the debug scale (read from docs/training.md: "The same run at the debug scale"), so
every command line and setting is the doc's.

tokenize -> data_report -> plan -> gpu_check (parity only, ``--no-step``: its cheapest
documented form; the whole check is tests/test_gpu_evidence.py's) -> held-out tokens -> train (2 CP
ranks, on the token folder, snapshots, a Hugging Face export at the end) -> evaluate (before
training it is the same command) -> convert the last snapshot back to a Hugging Face folder. The
commands that take one process run in this one (their ``main`` with the same argv: torch is
imported once), the others under torchrun. The converted folder equals the trainer's own export,
and transformers, loading it, gives evaluate's loss on the held-out tokens, each document on its
own as the document mask has it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from harness import run_command
from hf_tiny import load_reference, safetensors_weights, write_tiny_hf_llama

from upipe_dtensor.commands import convert
from upipe_dtensor.data import report, tokenize
from upipe_dtensor.planning import cli as plan_cli

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
WORDS = "river stone cloud lantern orchard signal harbor meadow copper violet thread".split()


def debug_scale_job(*, model: Path, tokens: Path, dump: Path) -> str:
    """docs/training.md's my_run.toml at the debug scale, read from the doc, its paths this run's
    (the recipe it extends by its absolute path: the job file lives elsewhere)."""
    text = (REPO / "docs" / "training.md").read_text()
    start = text.index("```toml\n# my_run.toml at the debug scale") + len("```toml\n")
    block = text[start : text.index("```", start)]
    for doc_path, path in {
        "recipes/llama3_8b_extend_1M.toml": REPO / "recipes" / "llama3_8b_extend_1M.toml",
        "outputs/my_run": dump,
        "/models/tiny-llama": model,
        "/data/my_docs_tokens": tokens,
    }.items():
        assert f'"{doc_path}"' in block, doc_path
        block = block.replace(f'"{doc_path}"', f'"{path}"')
    return block


def _documents(count: int, seed: int) -> list[str]:
    draw = np.random.default_rng(seed)
    return [" ".join(draw.choice(WORDS, int(draw.integers(4, 40)))) for _ in range(count)]


def _run(*command: str, processes: int = 0, timeout: float = 600) -> str:
    """One command as a user types it (under ``torchrun`` with ``processes``), from the repo root;
    its stdout, after asserting it succeeded."""
    returncode, stdout, stderr = run_command(*command, processes=processes, timeout=timeout)
    assert returncode == 0, f"{command}: {stderr[-3000:]}"
    return stdout


def _script(name: str):
    """A script of scripts/ as a module (its main takes the command's argv)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def _document_loss(model, rows: np.ndarray, eos_id: int) -> float:
    """transformers' mean next-token loss over the rows, each document (ending at its EOS) run
    on its own from position 0: what a document mask with per-document positions computes."""
    losses = []
    for row in torch.from_numpy(rows.astype(np.int64)):
        ends = [int(i) + 1 for i in torch.nonzero(row == eos_id)]
        bounds = [0, *[end for end in ends if end < len(row)], len(row)]
        with torch.no_grad():
            logits = torch.cat(
                [model(row[a:b].unsqueeze(0)).logits[0] for a, b in zip(bounds, bounds[1:])]
            )
        losses.append(F.cross_entropy(logits[:-1], row[1:], reduction="none"))
    return torch.cat(losses).mean().item()


def test_worked_run_end_to_end(tmp_path: Path, capsys) -> None:
    model = write_tiny_hf_llama(tmp_path / "Llama-tiny")  # stands for /models/Llama-3.1-8B
    data = tmp_path / "my_docs"
    data.mkdir()
    (data / "part-0.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in _documents(150, 0))
    )
    pq.write_table(pa.table({"text": _documents(150, 1)}), data / "part-1.parquet")
    (tmp_path / "held_out.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in _documents(40, 2))
    )
    tokens, out = tmp_path / "my_docs_tokens", tmp_path / "outputs" / "my_run"
    job = tmp_path / "my_run.toml"
    job.write_text(debug_scale_job(model=model, tokens=tokens, dump=out))

    def command(main, *argv: str) -> str:
        """A one-process command, run in this process (its argv as typed); its stdout."""
        capsys.readouterr()
        assert main(list(argv)) == 0, capsys.readouterr().err[-3000:]
        return capsys.readouterr().out

    summary = _last_json(
        command(
            tokenize.main, "--config", str(job),
            "--training.dataset_path", str(data), "--output", str(tokens),
        )
    )  # fmt: skip
    assert summary["documents"] == 300 and summary["dtype"] == "uint16"

    lengths = _last_json(command(report.main, "--config", str(job)))  # from the offsets
    assert sum(row["documents"] for row in lengths["lengths"]) == 300

    plan = command(plan_cli.main, "--config", str(job), "--json")
    assert json.loads(plan[plan.index("{") :])["fits"] is True  # one indented JSON object

    check = _run("-m", "upipe_dtensor.gpu_check", "--device", "cpu", "--no-step", processes=2)
    assert "| UPipe (U = C) | sdpa |" in check

    held_out = tmp_path / "eval.npy"
    command(
        _script("make_eval_tokens").main, str(tmp_path / "held_out.jsonl"), str(held_out),
        "--rows", "2", "--seq-len", "64", "--tokenizer", str(model),
    )  # fmt: skip

    trained = _run("train.py", "--config", str(job), processes=2)
    assert "step     4 |" in trained and (out / "checkpoint" / "step-4-hf").is_dir()

    evaluate = ("-m", "upipe_dtensor.evaluate", "--config", str(job), "--tokens", str(held_out))
    after = _last_json(_run(*evaluate, processes=2))
    assert list(out.glob("loss_by_position_eval_step-4_*.png"))  # the snapshot's weights

    converted = tmp_path / "Llama-tiny-trained"
    command(
        convert.main, "--to", "hf", str(out / "checkpoint" / "step-4"), str(converted),
        "--config", str(job),
    )  # fmt: skip
    exported = safetensors_weights(out / "checkpoint" / "step-4-hf")
    ours = safetensors_weights(converted)
    assert ours.keys() == exported.keys()
    assert all(torch.equal(ours[name], exported[name]) for name in ours)
    # The trained weights, read back by transformers: evaluate's loss, document by document.
    reference = _document_loss(load_reference(converted), np.load(held_out), eos_id=1)
    assert abs(reference - after["loss"]) <= 1e-5 * reference, (reference, after["loss"])
