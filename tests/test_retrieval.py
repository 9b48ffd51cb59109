"""``evaluate --task passkey|needle`` against ``transformers``: on the tiny HF Llama at cp = 2 the
answer log-probabilities, the argmax at every answer position and so the greedy exact match equal
transformers' own on the same prompts, under UPipe (the command itself, JSON and heatmap) and under
FPDT with small chunks (the answer's tokens spread over both ranks); bad input stops before any
process group with the fix."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from hf_tiny import load_reference, write_tiny_hf_llama

from upipe_dtensor import evaluate
from upipe_dtensor.commands.evaluate import load_job_model
from upipe_dtensor.commands.retrieval import Prompt, TaskRequest, prepare_prompts, score_prompts

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
LENGTHS, DEPTHS = "96,160", "0,0.5,1"


def _overrides(dump: Path, hf: Path, *extra: str) -> list[str]:
    return [
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
        "--training.dataset_path",
        str(REPO / "assets/corpus"),
        "--parallelism.context_parallel_degree",
        "2",
        "--metrics.enable_tensorboard",
        "false",
        *extra,
    ]


def _reference(model, prompt: Prompt) -> tuple[float, list[int]]:
    """transformers' log p(answer | prompt) and argmax at each answer position."""
    with torch.no_grad():
        logits = model(prompt.tokens[None]).logits[0].double()
    start = prompt.answer_start
    rows = logits[start - 1 : -1]
    logprob = rows.log_softmax(-1).gather(1, prompt.tokens[start:, None]).sum().item()
    return logprob, rows.argmax(-1).tolist()


def _greedy_prompt(model, prompt: Prompt) -> Prompt:
    """``prompt`` with its answer replaced by transformers' greedy continuation (token by token,
    each decoded from the ones before): a prompt whose exact match must be true."""
    tokens = prompt.tokens.clone()
    for position in range(prompt.answer_start, prompt.length):
        with torch.no_grad():
            tokens[position] = model(tokens[None, :position]).logits[0, -1].argmax()
    return Prompt(prompt.length, prompt.depth, tokens, prompt.answer_tokens)


def _score_on_ranks(rank: int, world: int, overrides: list, prompts: list, out: str) -> None:
    """Per-prompt scores under UPipe and under FPDT in 8-token chunks, then the command itself
    under UPipe; rank 0 writes them all."""
    results = {}
    for name, extra in [
        ("upipe", []),
        ("fpdt", ["--parallelism.cp_style", "fpdt", "--parallelism.chunk_tokens", "8"]),
    ]:
        config, _ = prepare_prompts(TaskRequest("passkey", LENGTHS, DEPTHS), overrides + extra)
        built, _, _ = load_job_model(config)
        scores = score_prompts(built, prompts)
        results[name] = [
            (s.logprob, s.predicted, s.exact_match(p)) for s, p in zip(scores, prompts)
        ]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = evaluate.main(
            [*overrides, "--task", "passkey", "--lengths", LENGTHS, "--depths", DEPTHS]
        )
    assert code == 0
    if rank == 0:
        results["command"] = json.loads(stdout.getvalue().strip().splitlines()[-1])
        Path(out).write_text(json.dumps(results))


def test_scores_equal_transformers_at_cp2(tmp_path: Path) -> None:
    hf = write_tiny_hf_llama(tmp_path / "tiny-llama")
    overrides = _overrides(tmp_path / "out", hf)
    _, prompts = prepare_prompts(TaskRequest("passkey", LENGTHS, DEPTHS), overrides)
    assert [(p.length, p.depth) for p in prompts] == [
        (n, d) for n in (96, 160) for d in (0.0, 0.5, 1.0)
    ]
    reference = load_reference(hf)
    prompts.append(_greedy_prompt(reference, prompts[2]))
    expected = [_reference(reference, p) for p in prompts]
    assert expected[-1][1] == prompts[-1].tokens[prompts[-1].answer_start :].tolist()

    run_on_ranks(2, _score_on_ranks, overrides, prompts, str(tmp_path / "scores.json"))
    results = json.loads((tmp_path / "scores.json").read_text())
    worst = 0.0
    for style in ("upipe", "fpdt"):
        for (logprob, predicted, match), (ref_logprob, ref_predicted), prompt in zip(
            results[style], expected, prompts, strict=True
        ):
            worst = max(worst, abs(logprob - ref_logprob))
            assert abs(logprob - ref_logprob) <= 1e-4, (style, prompt.length, prompt.depth)
            assert predicted == ref_predicted, (style, prompt.length, prompt.depth)
            answer = prompt.tokens[prompt.answer_start :].tolist()
            assert match == (ref_predicted == answer)
        assert [match for *_, match in results[style]] == [False] * 6 + [True]
    print(f"answer logprob vs transformers: max abs error {worst:.1e} (UPipe and FPDT, cp=2)")

    command = results["command"]
    assert command["task"] == "passkey"
    assert [(c["length"], c["depth"]) for c in command["scores"]] == [
        (p.length, p.depth) for p in prompts[:6]
    ]
    for cell, (logprob, _, match) in zip(command["scores"], results["upipe"]):
        assert cell["logprob"] == pytest.approx(logprob, abs=1e-9)
        assert cell["exact_match"] == float(match)
    assert command["heatmap"] == str(tmp_path / "out" / "passkey_hf.png")
    assert Path(command["heatmap"]).stat().st_size > 0


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--lengths", "96,161,1K,255"],
            r"--lengths: 161, 255 token\(s\) cannot be split over "
            r"context_parallel_degree = 2; use multiples of 2: 161 -> 160, 255 -> 254",
        ),
        (["--lengths", "40"], r"40 tokens cannot hold a prompt .* use lengths of at least \d+"),
        (["--lengths", "96,1G"], r"'1G' is not a token count"),
        (["--depths", "0,1.5"], r"'1.5' is not a depth in \[0, 1\]"),
        (["--haystack", "missing.txt"], r"--haystack: dataset_path 'missing.txt' does not exist"),
        (["--samples", "0"], r"--samples 0: use 1 or more"),
        (["--digits", "0"], r"--digits 0: use 1 to 18 digits"),
    ],
)
def test_bad_input_is_named_before_any_process_group(
    tmp_path: Path, capsys, extra: list[str], message: str
) -> None:
    assert evaluate.main([*_debug_job(tmp_path), "--task", "passkey", *extra]) == 2
    assert re.search(message, capsys.readouterr().err), message
    assert not dist.is_initialized()


def test_existing_heatmap_is_refused_before_any_process_group(tmp_path: Path, capsys) -> None:
    (tmp_path / "passkey_dcp.png").write_bytes(b"earlier")  # the seed's (DCP) initial weights
    job = [*_debug_job(tmp_path), "--checkpoint.initial_load_path", str(tmp_path)]
    assert evaluate.main([*job, "--task", "passkey", "--lengths", "128"]) == 2
    assert "passkey_dcp.png already exists; an earlier run" in capsys.readouterr().err
    assert (tmp_path / "passkey_dcp.png").read_bytes() == b"earlier"
    assert not dist.is_initialized()


def _debug_job(dump: Path) -> list[str]:
    """The debug model's job writing to ``dump``, with no weights."""
    return [
        "--config",
        str(REPO / "train_configs/debug_model.toml"),
        "--job.dump_folder",
        str(dump),
        "--model.tokenizer_path",
        str(REPO / "assets/tokenizer"),
        "--training.dataset_path",
        str(REPO / "assets/corpus"),
    ]
