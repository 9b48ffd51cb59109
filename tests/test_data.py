"""The text pipeline: assets, tokenizer, readers, packing, dp sharding, resume and errors."""

from __future__ import annotations

import itertools
import json
import pickle
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from upipe_dtensor.data.loader import LocalDocuments, PackedTextLoader, build_tokenizer

pytestmark = pytest.mark.unit

ASSETS = Path(__file__).resolve().parents[1] / "assets"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(str(ASSETS / "tokenizer"))


def _docs(n: int) -> list[str]:
    """Distinct documents of varied length, so windows cut through their middles."""
    return [
        f"Document {i} says: " + "the quick brown fox jumps " * (1 + 7 * i % 5) for i in range(n)
    ]


def _write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    return path


def _loader(tokenizer, path, **overrides) -> PackedTextLoader:
    kwargs = dict(
        dataset="local",
        dataset_path=str(path),
        text_field="text",
        tokenizer=tokenizer,
        seq_len=16,
        batch_size=2,
        dp_rank=0,
        dp_world_size=1,
    )
    return PackedTextLoader(**(kwargs | overrides))


def _stream(tokenizer, docs: list[str]) -> list[int]:
    return [t for d in docs for t in [tokenizer.bos_id, *tokenizer.encode(d), tokenizer.eos_id]]


def _flat(batches) -> list[int]:
    """The token stream the batches were cut from (windows are consecutive, non-overlapping)."""
    return [
        t
        for inputs, labels in batches
        for row_in, row_lab in zip(inputs, labels)
        for t in [*row_in.tolist(), row_lab[-1].item()]
    ]


# --- shipped assets and tokenizer -----------------------------------------------------------------


def test_shipped_tokenizer(tokenizer):
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (2048, 0, 1)
    text = "Return a new view of the dictionary's keys -- naïve café, 3.14 ≤ π.\n\tIndented."
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    specials_as_text = tokenizer.encode("<|begin_of_text|> <|end_of_text|>")
    assert {tokenizer.bos_id, tokenizer.eos_id}.isdisjoint(specials_as_text)
    assert tokenizer.encode(text, add_bos=True, add_eos=True) == [0, *ids, 1]
    prose = "Return the number of items in the sequence, or raise an exception if it is missing."
    assert len(tokenizer.encode(prose)) < len(prose) / 3  # merges learned English words


def test_build_tokenizer_accepts_the_json_file(tokenizer):
    from_file = build_tokenizer(str(ASSETS / "tokenizer" / "tokenizer.json"))
    assert from_file.encode("A sentence.") == tokenizer.encode("A sentence.")
    assert (from_file.bos_id, from_file.eos_id) == (tokenizer.bos_id, tokenizer.eos_id)


def test_shipped_corpus_has_distinct_documents_in_every_format():
    files = LocalDocuments(str(ASSETS / "corpus"), "text").files
    assert {f.suffix for f in files} == {".txt", ".jsonl", ".parquet"}
    per_file = [list(LocalDocuments(str(f), "text")) for f in files]
    assert all(len(docs) >= 10 for docs in per_file)
    every = [d for docs in per_file for d in docs]
    assert len(set(every)) == len(every)
    assert 500_000 < sum(map(len, every)) < 1_500_000
    assert sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file()) < 3_000_000


@pytest.mark.parametrize("broken", ["missing", "no_json", "malformed", "no_config"])
def test_build_tokenizer_errors(tmp_path, broken):
    if broken == "missing":
        path, match = tmp_path / "nope", "does not exist"
    elif broken == "no_json":
        path, match = tmp_path, "no tokenizer.json"
    elif broken == "malformed":
        (tmp_path / "tokenizer.json").write_text("{not json")
        path, match = tmp_path, "cannot load"
    else:
        shutil.copy(ASSETS / "tokenizer" / "tokenizer.json", tmp_path)
        path, match = tmp_path, "no BOS/EOS.*bos_token"
    with pytest.raises(ValueError, match=match):
        build_tokenizer(str(path))


# --- document readers -----------------------------------------------------------------------------


def test_each_format_yields_its_documents_in_sorted_path_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("  first doc\n\f\n\n\f second\ndoc  \n")  # blank part dropped
    (tmp_path / "b" / "c.txt").write_text("one whole file\n\nwith a blank line")
    (tmp_path / "b" / "d.jsonl").write_text(
        '{"text": "json one", "x": 1}\n\n{"text": "   "}\n{"text": "json two"}\n'
    )
    pq.write_table(pa.table({"text": ["pq one", "pq two"], "n": [1, 2]}), tmp_path / "e.parquet")
    (tmp_path / "notes.md").write_text("ignored: not a supported suffix")
    with pytest.raises(ValueError, match=r"d.jsonl:3: the document text is blank; fix or remove"):
        list(LocalDocuments(str(tmp_path), "text"))  # a blank record is a bad record
    assert list(LocalDocuments(str(tmp_path), "text", skip_bad=True)) == [
        "first doc",
        "second\ndoc",
        "one whole file\n\nwith a blank line",
        "json one",
        "json two",
        "pq one",
        "pq two",
    ]
    assert list(LocalDocuments(str(tmp_path / "e.parquet"), "text")) == ["pq one", "pq two"]


# --- packing --------------------------------------------------------------------------------------


def test_windows_are_the_packed_stream_shifted_by_one(tokenizer, tmp_path):
    docs = _docs(7)
    loader = _loader(tokenizer, _write_jsonl(tmp_path / "d.jsonl", docs), seq_len=13, batch_size=3)
    batches = list(itertools.islice(loader, 20))
    for inputs, labels in batches:
        assert inputs.shape == labels.shape == (3, 13)
        assert inputs.dtype == labels.dtype == torch.long
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
    stream = _stream(tokenizer, docs)
    flat = _flat(batches)
    assert len(flat) > 2 * len(stream)  # the corpus came round twice, in the same order
    assert flat == (stream * 3)[: len(flat)]
    assert batches[0][0][0, 0] == tokenizer.bos_id


def test_dp_ranks_get_disjoint_documents_round_robin(tokenizer, tmp_path):
    docs = _docs(10)
    path = _write_jsonl(tmp_path / "d.jsonl", docs)
    seen = []
    for rank in range(3):
        loader = _loader(tokenizer, path, seq_len=31, dp_rank=rank, dp_world_size=3)
        pieces, current = [], []
        for t in _flat(itertools.islice(loader, 6)):
            if t == tokenizer.eos_id:
                pieces.append(tokenizer.decode(current))
                current = []
            elif t != tokenizer.bos_id:
                current.append(t)
        got = pieces[: len(docs[rank::3])]  # the first epoch; the stream starts over after it
        assert got == docs[rank::3]
        seen.append(set(got))
    assert set.union(*seen) == set(docs) and sum(map(len, seen)) == len(docs)


def test_loaders_of_one_dp_rank_agree(tokenizer):
    """Context-parallel ranks build their loaders independently; their batches must match."""
    a, b = (
        _loader(tokenizer, ASSETS / "corpus", seq_len=512, dp_rank=1, dp_world_size=2)
        for _ in range(2)
    )
    for (xa, ya), (xb, yb) in zip(itertools.islice(a, 5), itertools.islice(b, 5)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


# --- resume ---------------------------------------------------------------------------------------


class _CountingTokenizer:
    """Forwards to the real tokenizer and counts encode calls (resume must not re-tokenize)."""

    def __init__(self, inner):
        self.inner, self.bos_id, self.eos_id, self.calls = inner, inner.bos_id, inner.eos_id, 0

    def encode(self, text):
        self.calls += 1
        return self.inner.encode(text)


def test_resume_matches_uninterrupted_run(tokenizer, tmp_path):
    docs = _docs(9)
    path = tmp_path / "corpus"
    path.mkdir()
    (path / "a.txt").write_text("\f".join(docs[:4]))
    _write_jsonl(path / "b.jsonl", docs[4:])
    geometry = dict(seq_len=11, batch_size=2, dp_rank=1, dp_world_size=2)
    reference = _loader(tokenizer, path, **geometry)
    batches, states = [], [reference.state_dict()]
    for batch in itertools.islice(reference, 30):
        batches.append(batch)
        states.append(pickle.loads(pickle.dumps(reference.state_dict())))
    mid_document = [k for k, s in enumerate(states) if s["offset"] > 0]
    wraps = [k for k in range(30) if states[k]["epoch"] < states[k + 1]["epoch"]]
    assert mid_document and len(wraps) >= 2  # the cut points below include both cases
    for k in sorted({0, 1, mid_document[0], wraps[0], wraps[0] + 1, wraps[1], 25}):
        counting = _CountingTokenizer(tokenizer)
        resumed = _loader(counting, path, **geometry)
        resumed.load_state_dict(states[k])
        for i, (inputs, labels) in enumerate(itertools.islice(resumed, 30 - k)):
            if i == 0:
                assert counting.calls <= 3, "resume tokenized documents before the cursor"
            assert torch.equal(inputs, batches[k + i][0]), (k, i)
            assert torch.equal(labels, batches[k + i][1]), (k, i)


def test_load_state_dict_repositions_a_running_iterator(tokenizer):
    loader = _loader(tokenizer, ASSETS / "corpus", seq_len=300)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    expected = [next(it) for _ in range(3)]
    loader.load_state_dict(state)
    for (x, y), (ex, ey) in zip((next(it) for _ in range(3)), expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_resume_refuses_another_dp_geometry(tokenizer):
    state = _loader(tokenizer, ASSETS / "corpus", dp_rank=0, dp_world_size=2).state_dict()
    other = _loader(tokenizer, ASSETS / "corpus", dp_rank=0, dp_world_size=4)
    with pytest.raises(ValueError, match="saved by dp rank 0 of 2.*same data-parallel degree"):
        other.load_state_dict(state)


# --- Hugging Face datasets (mocked: no network here) ----------------------------------------------


def test_hub_dataset_is_streamed(tokenizer, monkeypatch):
    """The dataset's subset ([training] dataset_config_name, what load_dataset calls name) and
    split reach load_dataset; the default is no subset and split "train"."""
    import datasets

    import upipe_dtensor.data.loader as loader_module

    monkeypatch.setattr(loader_module, "hub_unreachable", lambda name: "")  # as if online
    calls = []

    def fake_load_dataset(name, config_name=None, *, split, streaming):
        calls.append((name, config_name, split, streaming))
        return [{"content": d} for d in _docs(5)]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    hub = dict(dataset="org/corpus", seq_len=8, batch_size=1)
    loader = _loader(
        tokenizer, "", **hub, text_field="content", split="validation", dataset_config_name="en"
    )
    assert calls == [("org/corpus", "en", "validation", True)]
    assert loader.documents.description == (
        "Hugging Face dataset 'org/corpus' subset 'en' split 'validation'"
    )
    flat = _flat(itertools.islice(loader, 10))
    assert flat == _stream(tokenizer, _docs(5))[: len(flat)]
    with pytest.raises(ValueError, match="'org/corpus'.*example 0.*no field 'text'.*'content'"):
        next(iter(_loader(tokenizer, "", **hub)))
    assert calls[-1] == ("org/corpus", None, "train", True)


# --- bad input ------------------------------------------------------------------------------------


def _bad(tmp_path: Path, case: str) -> tuple[dict, str]:
    """Loader keyword overrides for one bad input, and the error it must raise when built."""
    bad = tmp_path / "bad"
    bad.mkdir()
    if case == "missing":
        return {"dataset_path": str(bad / "nope")}, "does not exist"
    if case == "empty_path":
        return {"dataset_path": ""}, "does not exist"
    if case == "unsupported_file":
        (bad / "x.csv").write_text("text\nhi\n")
        return {"dataset_path": str(bad / "x.csv")}, "not a supported file"
    if case == "no_files":
        (bad / "x.csv").write_text("text\nhi\n")
        return {"dataset_path": str(bad)}, "holds no .txt/.jsonl/.parquet files"
    if case == "jsonl_field":
        _write_jsonl(bad / "d.jsonl", ["a"])
        return (
            {"dataset_path": str(bad), "text_field": "body"},
            r"d.jsonl:1: .*no field 'body'.*set text_field",
        )
    if case == "parquet_field":
        pq.write_table(pa.table({"content": ["a"]}), bad / "d.parquet")
        return {"dataset_path": str(bad)}, r"d.parquet: has no column 'text'.*\['content'\]"
    if case == "bad_json":
        (bad / "d.jsonl").write_text("{'text': 'single quotes'}\n")
        return {"dataset_path": str(bad)}, r"d.jsonl:1: not valid JSON, one object per line"
    if case == "seq_len":
        return {"seq_len": 0}, "seq_len must be >= 1"
    if case == "batch_size":
        return {"batch_size": 0}, "batch_size must be >= 1"
    if case == "dp_rank":
        return {"dp_rank": 2, "dp_world_size": 2}, r"dp_rank must be in \[0, 2\)"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "empty_path",
        "unsupported_file",
        "no_files",
        "jsonl_field",
        "parquet_field",
        "bad_json",
        "seq_len",
        "batch_size",
        "dp_rank",
    ],
)
def test_bad_input_fails_at_construction(tokenizer, tmp_path, case):
    good = tmp_path / "good"
    good.mkdir()
    (good / "a.txt").write_text("fine")
    overrides, match = _bad(tmp_path, case)
    with pytest.raises(ValueError, match=match):
        _loader(tokenizer, good, **overrides)


@pytest.mark.parametrize("case", ["blank", "too_few", "later_line", "null"])
def test_bad_corpus_fails_on_first_batch(tokenizer, tmp_path, case):
    if case == "blank":
        (tmp_path / "a.txt").write_text(" \n\f\n ")
        rank, match = 0, "has 0 non-blank documents, so dp rank 0 of 2 gets none"
    elif case == "too_few":
        (tmp_path / "a.txt").write_text("only one document")
        rank, match = 1, "has 1 non-blank documents, so dp rank 1 of 2 gets none"
    elif case == "later_line":
        (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n{"body": "wrong field"}\n')
        rank, match = 0, r"d.jsonl:2: record has no field 'text'"
    else:
        pq.write_table(pa.table({"text": ["ok", None]}), tmp_path / "d.parquet")
        rank, match = 0, r"d.parquet row 1: the document text is NoneType"
    loader = _loader(tokenizer, tmp_path, seq_len=64, dp_rank=rank, dp_world_size=2)
    with pytest.raises(ValueError, match=match):
        next(iter(loader))


# --- start-up warnings ----------------------------------------------------------------------------


def _warned(tmp_path: Path, caplog, *overrides: str, job: str = "") -> list[str]:
    """The warnings the trainer's checks before any process group log for the debug job (cp 1,
    one process) with these overrides, or for ``job``'s TOML extending it."""
    from upipe_dtensor.config import parse_args
    from upipe_dtensor.train.preflight import check_before_process_group

    config_file = str(ASSETS.parent / "train_configs" / "debug_model.toml")
    if job:
        (tmp_path / "job.toml").write_text(f'extends = "{config_file}"\n{job}')
        config_file = str(tmp_path / "job.toml")
    base = ["--parallelism.context_parallel_degree", "1", "--job.dump_folder", str(tmp_path)]
    config = parse_args(["--config", config_file, *base, *overrides])
    caplog.clear()
    with caplog.at_level("WARNING", logger="upipe_dtensor"):
        check_before_process_group(config)
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_data_that_trains_badly_gets_one_startup_line_each(tmp_path, caplog, monkeypatch):
    monkeypatch.chdir(ASSETS.parent)  # the debug job names assets/ relatively
    assert _warned(tmp_path, caplog) == []  # the Quick start's data: nothing to say

    tokenizer = build_tokenizer(str(ASSETS / "tokenizer"))
    small = _write_jsonl(tmp_path / "small.jsonl", _docs(3))
    (line,) = _warned(tmp_path, caplog, "--training.dataset_path", str(small))
    tokens = len(_stream(tokenizer, _docs(3)))  # the whole source is the sample: exact
    assert f"holds {tokens} tokens per data-parallel rank (1 rank), fewer than one" in line
    assert "seq_len + 1 = 513" in line

    mixture = (
        f'[[training.sources]]\npath = "{ASSETS / "corpus" / "stdlib_docs.jsonl"}"\n'
        f'[[training.sources]]\npath = "{tmp_path / "more.jsonl"}"\n'
    )
    _write_jsonl(tmp_path / "more.jsonl", _docs(30))
    (line,) = _warned(tmp_path, caplog, job=mixture)
    # Half of the tokens of the debug job's 60 steps of 4 sequences of 513 tokens:
    passes = 0.5 * 60 * 4 * 513 / len(_stream(tokenizer, _docs(30)))
    more = f"#2 path '{tmp_path / 'more.jsonl'}'"
    assert f"this job's 60 steps read [[training.sources]] {more} {passes:.0f} times over" in line
    assert "#1" not in line and "times over" in line

    (tmp_path / "lines").mkdir()
    (tmp_path / "lines" / "one_per_line.txt").write_text(
        "".join(f"item {i}: the quick brown fox jumps over the lazy dog\n" for i in range(1200))
    )
    lines = ["--training.dataset_path", str(tmp_path / "lines"), "--training.steps", "5"]
    (line,) = _warned(tmp_path, caplog, *lines)
    assert "1 .txt file of 1,000 lines or more is read as one document" in line
    assert "one_per_line.txt (1,200 lines)" in line and "form feeds" in line
