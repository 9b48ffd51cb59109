"""Token folders (``python -m upipe_dtensor.tokenize``): the same batches as the text they were
made from (one source, dp sharding, epochs, a mixture with upsampling), an O(1) resume, the
manifest's hashes and counts, atomic writes, and the refusals (another tokenizer, a damaged
folder, a changed folder on resume)."""

from __future__ import annotations

import hashlib
import itertools
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from upipe_dtensor.config import ConfigError
from upipe_dtensor.config.schema import DataSource
from upipe_dtensor.data import tokenize as tokenize_command
from upipe_dtensor.data.checks import data_changes, data_fingerprint, scan_sources
from upipe_dtensor.data.loader import PackedTextLoader, build_tokenizer
from upipe_dtensor.data.token_files import TokenFolder, is_token_folder, token_dtype

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
DEBUG_JOB = REPO / "train_configs" / "debug_model.toml"
TOKENIZER = REPO / "assets" / "tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(str(TOKENIZER))


def _texts(count: int, seed: int) -> list[str]:
    """Documents of 3 to 150 words: some shorter than a window, some spanning several."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    draw = np.random.default_rng(seed)
    return [
        f"doc {seed}-{i}: " + " ".join(draw.choice(words, int(draw.integers(3, 150))))
        for i in range(count)
    ]


def _tokenize(data: Path, out: Path, *overrides: str, workers: int = 1) -> dict:
    return tokenize_command.tokenize(
        str(DEBUG_JOB),
        ["--training.dataset_path", str(data), "--model.tokenizer_path", str(TOKENIZER)]
        + list(overrides),
        str(out),
        workers=workers,
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """A small text corpus (a .jsonl and a form-feed .txt) and its token folder."""
    root = tmp_path_factory.mktemp("corpus")
    text = root / "text"
    text.mkdir()
    (text / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(23, 1)))
    (text / "b.txt").write_text("\f".join(_texts(11, 2)))
    _tokenize(text, root / "tokens")
    return text, root / "tokens"


def _loader(tokenizer, path, **overrides) -> PackedTextLoader:
    kwargs = dict(
        dataset="local",
        dataset_path=str(path),
        text_field="text",
        tokenizer=tokenizer,
        seq_len=97,
        batch_size=2,
        dp_rank=1,
        dp_world_size=2,
    )
    return PackedTextLoader(**(kwargs | overrides))


def _equal_batches(a, b, count: int) -> None:
    for i, ((xa, ya), (xb, yb)) in enumerate(itertools.islice(zip(a, b), count)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb), i


def test_manifest_counts_hashes_and_dtype(corpus, tokenizer):
    text, tokens = corpus
    manifest = json.loads((tokens / "tokens.json").read_text())
    texts = _texts(23, 1) + _texts(11, 2)
    lengths = [len(tokenizer.encode(t)) + 2 for t in texts]
    assert (manifest["documents"], manifest["tokens"], manifest["dtype"]) == (
        len(texts),
        sum(lengths),
        "uint16",
    )
    for name, key in (("tokens.bin", "tokens_sha256"), ("documents.bin", "documents_sha256")):
        assert hashlib.sha256((tokens / name).read_bytes()).hexdigest() == manifest[key]
    folder = TokenFolder.open(str(tokens))
    assert folder.lengths().tolist() == lengths
    assert folder.document(5).tolist() == [0, *tokenizer.encode(texts[5]), 1]
    assert (
        manifest["tokenizer"]["tokenizer_json_sha256"]
        == hashlib.sha256((TOKENIZER / "tokenizer.json").read_bytes()).hexdigest()
    )
    assert [token_dtype(n).name for n in (256, 257, 65536, 65537, 128256)] == [
        "uint8",
        "uint16",
        "uint16",
        "uint32",
        "uint32",
    ]


def test_workers_write_the_same_folder(corpus, tmp_path, monkeypatch):
    """Many small pieces through 2 worker processes come back in order: the same bytes."""
    text, tokens = corpus
    monkeypatch.setattr(tokenize_command, "BATCH_CHARACTERS", 2000)
    _tokenize(text, tmp_path / "parallel", workers=2)
    for name in ("tokens.bin", "documents.bin"):
        assert (tmp_path / "parallel" / name).read_bytes() == (tokens / name).read_bytes()


def test_token_folder_gives_the_text_batches(corpus, tokenizer):
    """dp rank 1 of 2, past several epochs (the corpus is about 12 windows per rank)."""
    text, tokens = corpus
    a, b = _loader(tokenizer, text), _loader(tokenizer, tokens)
    _equal_batches(a, b, 40)
    assert b.state_dict()["epoch"] >= 2


def test_mixture_of_a_token_folder_and_text_gives_the_text_mixture(corpus, tokenizer, tmp_path):
    """Upsampled copies of a token folder's documents land where the text's do."""
    text, tokens = corpus
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(9, 3)))
    upsampled = dict(weight=2.0, upsample_min_tokens=200, upsample_factor=3)
    mixtures = [
        [DataSource(str(path), **upsampled), DataSource(str(other))] for path in (text, tokens)
    ]
    a, b = (_loader(tokenizer, "", sources=sources, seed=3) for sources in mixtures)
    _equal_batches(a, b, 60)
    assert any(s.get("copies") for s in b.state_dict()["sources"][:1])


def test_resume_is_a_position_not_a_replay(corpus, tokenizer):
    """From the state after any batch (copies of upsampled documents waiting, several epochs
    in) a new loader yields the uninterrupted batches, reading only the documents its next
    batch holds: none of those before the position, as a replay would."""
    _, tokens = corpus
    upsampled = [DataSource(str(tokens), upsample_min_tokens=200, upsample_factor=2)]
    reference = _loader(tokenizer, "", sources=upsampled)
    batches, states = [], [pickle.loads(pickle.dumps(reference.state_dict()))]
    for batch in itertools.islice(reference, 40):
        batches.append(batch)
        states.append(pickle.loads(pickle.dumps(reference.state_dict())))
    assert states[-1]["epoch"] >= 1 and any(state["copies"] for state in states)
    for k in (0, 9, 23, 39):
        resumed = _loader(tokenizer, "", sources=upsampled)
        resumed.load_state_dict(states[k])
        folder, reads = resumed.stream.folder, []
        document = folder.document
        folder.document = lambda index, reads=reads, document=document: (
            reads.append(index) or document(index)
        )
        for i, batch in enumerate(itertools.islice(resumed, 40 - k)):
            if i == 0:  # the documents the batch holds, and the one it may start at the end of
                assert len(reads) <= int((batch[0] == tokenizer.eos_id).sum()) + 3, (k, reads)
            assert all(torch.equal(x, y) for x, y in zip(batch, batches[k + i])), (k, i)


def test_a_failed_write_leaves_nothing(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "fine"}\n' * 3 + '{"body": "no text field"}\n')
    out = tmp_path / "out" / "tokens"
    with pytest.raises(ConfigError, match=r"data.jsonl:4: record has no field 'text'"):
        _tokenize(data, out)
    assert not out.parent.exists() or not any(out.parent.iterdir())
    summary = _tokenize(data, out, "--training.skip_bad_records", "true")
    assert summary["documents"] == 3 and is_token_folder(out)
    assert json.loads((out / "tokens.json").read_text())["source"]["skipped_records"] == 1
    with pytest.raises(ConfigError, match=r"is not empty.*pass --overwrite"):
        _tokenize(data, out)


def test_damaged_folder_and_other_tokenizer_are_refused(corpus, tokenizer, tmp_path):
    _, tokens = corpus
    copy = tmp_path / "copy"
    shutil.copytree(tokens, copy)
    with (copy / "tokens.bin").open("r+b") as handle:
        handle.truncate(1000)
    with pytest.raises(ValueError, match=r"tokens.bin has 1,000 bytes, its manifest says"):
        _loader(tokenizer, copy)
    other = tmp_path / "tokenizer"
    shutil.copytree(TOKENIZER, other)
    (other / "tokenizer.json").write_text((TOKENIZER / "tokenizer.json").read_text() + "\n")
    with pytest.raises(ValueError, match=r"was tokenized with .* tokenizer_path .* differs"):
        _loader(build_tokenizer(str(other)), tokens)


def test_resume_on_another_folder_names_the_change(corpus, tokenizer, tmp_path):
    """The manifest's hashes are the fingerprint: the same tokens moved elsewhere resume; other
    tokens are named as changed files and as other documents than those read."""
    text, tokens = corpus

    def fingerprint(path: Path):
        loader = _loader(tokenizer, path, dp_rank=0, dp_world_size=1)
        files = scan_sources([str(path)], "text").files
        return loader, data_fingerprint(loader.documents.description, files)

    loader, saved = fingerprint(tokens)
    next(iter(loader))
    saved["read"] = {"0": loader.read_state()}
    shutil.copytree(tokens, tmp_path / "moved")
    now, current = fingerprint(tmp_path / "moved")
    assert "documents read so far are unchanged" in data_changes(saved, current, 0, now.documents)
    shutil.copytree(text, tmp_path / "more")
    (tmp_path / "more" / "c.txt").write_text("one more document")
    _tokenize(tmp_path / "more", tmp_path / "more_tokens")
    now, current = fingerprint(tmp_path / "more_tokens")
    change = data_changes(saved, current, 0, now.documents)
    assert "2 files changed (documents.bin, tokens.bin)" in change
    assert "the token folder now holds other tokens" in change


def test_a_haystack_from_a_token_folder_asks_for_text(corpus):
    """evaluate --task fills haystacks with the job's text; a token folder has none."""
    from upipe_dtensor.commands.retrieval import haystack_documents
    from upipe_dtensor.config import parse_args

    config = parse_args(["--config", str(DEBUG_JOB), "--training.dataset_path", str(corpus[1])])
    with pytest.raises(ConfigError, match=r"is a token folder, and a haystack is text: pass --"):
        haystack_documents(config, None)
