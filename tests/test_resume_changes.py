"""A resume that changes what a step holds (``checkpointing/batch_record.py``): said in one line,
with what it means for the data and the schedule, and refused where the saved data position
cannot follow; and the claim that line makes about the data, checked on the loader itself.

The jobs run in this process as one rank (``python train.py`` without torchrun, cp 1): the debug
model at 128 tokens, a step in well under a second.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch

from upipe_dtensor.config import parse_args
from upipe_dtensor.data.loader import PackedTextLoader, build_tokenizer

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
DEBUG = REPO / "train_configs" / "debug_model.toml"
CORPUS = REPO / "assets" / "corpus"


@pytest.fixture
def one_process(monkeypatch) -> None:
    """No torchrun around, and whatever a one-process job sets in the environment undone."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def _job(tmp_path: Path, name: str, sources: list[tuple[str, float]]) -> Path:
    """A mixture job extending the debug job, all of them on one dump folder."""
    tables = "".join(
        f'[[training.sources]]\npath = "{CORPUS / path}"\nweight = {weight}\n'
        for path, weight in sources
    )
    job = tmp_path / f"{name}.toml"
    job.write_text(
        f'extends = "{DEBUG}"\n[job]\ndump_folder = "{tmp_path / "job"}"\n'
        f"[checkpoint]\ninterval = 1\n{tables}"
    )
    return job


def _train(job: Path, steps: int, *extra: str) -> int:
    spec = importlib.util.spec_from_file_location("train_entry", REPO / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    base = ["--parallelism.context_parallel_degree", "1", "--training.steps", str(steps)]
    return module.main(["--config", str(job), *base, "--training.seq_len", "128", *extra])


def test_a_resume_with_another_step_says_so_and_one_that_cannot_follow_is_refused(
    tmp_path: Path, capsys, one_process
) -> None:
    even = _job(tmp_path, "even", [("stdlib_docs.jsonl", 1.0), ("stdlib_docs_2.txt", 1.0)])
    assert _train(even, 2) == 0
    assert _train(even, 3) == 0  # the same step: nothing to say
    assert "with another step" not in capsys.readouterr().err

    tilted = _job(tmp_path, "tilted", [("stdlib_docs.jsonl", 1.0), ("stdlib_docs_2.txt", 3.0)])
    assert _train(tilted, 5, "--training.seq_len", "64") == 0
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if "with another step" in line]
    batch = parse_args(["--config", str(even)]).training.local_batch_size
    snapshot = tmp_path / "job" / "checkpoint" / "step-3"
    assert line.startswith(
        f"WARNING: resuming snapshot {snapshot} with another step: [training] seq_len 128 -> 64 "
        f"(tokens per step {128 * batch:,} -> {64 * batch:,}): the data goes on from the token "
        "the snapshot stopped at"
    )
    assert f"so the 2 steps left train {2 * 64 * batch:,} tokens, not {2 * 128 * batch:,}" in line
    assert "[[training.sources]] weights 1, 1 -> 1, 3 (shares 50%, 50% -> 25%, 75%)" in line

    swapped = _job(tmp_path, "swapped", [("stdlib_docs_2.txt", 1.0), ("stdlib_docs.jsonl", 1.0)])
    assert _train(swapped, 6) == 2
    err = capsys.readouterr().err
    assert (
        f"cannot resume snapshot {tmp_path / 'job' / 'checkpoint' / 'step-5'} on these "
        "[[training.sources]]: the same sources in another order" in err
    )
    assert "Traceback" not in err and not (tmp_path / "job" / "checkpoint" / "step-6").exists()


def test_the_data_goes_on_from_the_saved_token_in_windows_of_another_length() -> None:
    """What the line says about the data: a loader of another seq_len and batch, given the saved
    position, yields exactly the tokens the first loader would have read next."""
    tokenizer = build_tokenizer(str(REPO / "assets" / "tokenizer"))

    def loader(seq_len: int, batch_size: int) -> PackedTextLoader:
        return PackedTextLoader(
            dataset="local",
            dataset_path=str(CORPUS / "stdlib_docs.jsonl"),
            text_field="text",
            tokenizer=tokenizer,
            seq_len=seq_len,
            batch_size=batch_size,
            dp_rank=0,
            dp_world_size=1,
        )

    def tokens(batches) -> torch.Tensor:  # each window is seq_len + 1 tokens, in order
        return torch.cat([torch.cat([x, y[:, -1:]], 1).flatten() for x, y in batches])

    before = loader(97, 2)
    first = iter(before)
    next(first), next(first)
    state = before.state_dict()
    read_on = tokens(itertools.islice(first, 3))
    after = loader(31, 3)
    after.load_state_dict(state)
    resumed = tokens(itertools.islice(iter(after), 4))
    assert torch.equal(resumed[: len(read_on)], read_on[: len(resumed)])
