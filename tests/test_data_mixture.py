"""Data mixtures ([[training.sources]]): token shares, upsampling of long documents, seeded
copies, resume equal to an uninterrupted run, config errors, and data_report's numbers."""

from __future__ import annotations

import collections
import itertools
import json
import math
import pickle
import re
from pathlib import Path

import pytest
import torch

from upipe_dtensor.config import ConfigError, check_job, load_config
from upipe_dtensor.config.checks import check_training_data
from upipe_dtensor.config.schema import DataSource
from upipe_dtensor.data import report
from upipe_dtensor.data.loader import LocalDocuments, PackedTextLoader, build_tokenizer
from upipe_dtensor.data.mixture import COPY_SPREAD, SourceStream

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
DEBUG_RECIPE = REPO / "train_configs" / "debug_model.toml"


class _Words:
    """A tokenizer whose tokens are the words, as integers: documents of exact lengths, and
    every token names its document (``1000 * source + document``)."""

    bos_id, eos_id = 0, 1

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return [int(word) for word in text.split()]


def _write_source(path: Path, source: int, lengths: list[int]) -> Path:
    """Documents of these packed lengths (BOS and EOS included), as a .jsonl file."""
    lines = [
        json.dumps({"text": " ".join([str(1000 * source + doc)] * (length - 2))})
        for doc, length in enumerate(lengths)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _origin(tokens: list[int]) -> tuple[int, int]:
    """(source, document) of a packed document of ``_write_source``."""
    return divmod(tokens[1], 1000)


def _stream(path: Path, source: DataSource, *, seed=0, rank=0, world=1) -> SourceStream:
    return SourceStream(
        LocalDocuments(str(path), "text"),
        source,
        tokenizer=_Words(),
        dp_rank=rank,
        dp_world_size=world,
        seed=seed,
    )


def _loader(sources, tokenizer=None, **overrides) -> PackedTextLoader:
    kwargs = dict(
        dataset="local",
        dataset_path="",
        text_field="text",
        tokenizer=tokenizer or _Words(),
        seq_len=37,
        batch_size=2,
        dp_rank=0,
        dp_world_size=1,
        sources=sources,
    )
    return PackedTextLoader(**(kwargs | overrides))


def _batches_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# --- the one-source case --------------------------------------------------------------------------


def test_one_source_table_is_the_dataset_path_loader(tmp_path):
    path = _write_source(tmp_path / "a.jsonl", 1, [5 + 7 * i % 23 for i in range(12)])
    plain = _loader((), dataset_path=str(path), dp_rank=1, dp_world_size=2)
    table = _loader([DataSource(path=str(path))], dp_rank=1, dp_world_size=2)
    for a, b in itertools.islice(zip(plain, table), 15):
        assert _batches_equal(a, b)
    assert plain.state_dict() == table.state_dict()
    assert set(plain.state_dict()) == {
        "epoch", "document", "offset", "dp_rank", "dp_world_size", "read"
    }  # fmt: skip


# --- shares and upsampling ------------------------------------------------------------------------


def test_mixture_keeps_each_source_share_of_tokens(tmp_path):
    """Sources of very different document lengths get their weight's share of the tokens (not
    of the documents), and within the upsampled source its long documents get factor x their
    share of its tokens."""
    short = [4 + i % 5 for i in range(30)]  # 4..8 tokens
    long_and_short = [200 if i % 4 == 0 else 20 for i in range(12)]
    medium = [40 + 3 * i for i in range(10)]
    sources = [
        DataSource(str(_write_source(tmp_path / "short.jsonl", 1, short)), weight=3.0),
        DataSource(
            str(_write_source(tmp_path / "long.jsonl", 2, long_and_short)),
            weight=1.0,
            upsample_min_tokens=100,
            upsample_factor=3,
        ),
        DataSource(str(_write_source(tmp_path / "medium.jsonl", 3, medium)), weight=1.0),
    ]
    stream = _loader(sources).stream
    tokens = collections.Counter()
    long_tokens = 0
    for _, item in itertools.islice(stream.items(stream.start()), 6000):
        source, document = _origin(item)
        tokens[source] += len(item)
        long_tokens += len(item) if source == 2 and document % 4 == 0 else 0
    total = sum(tokens.values())
    bound = 3 * max(long_and_short) / total  # each source is within one document of its share
    for source, weight in ((1, 3 / 5), (2, 1 / 5), (3, 1 / 5)):
        assert abs(tokens[source] / total - weight) <= bound, (source, tokens, total)
    expected_long = 3 * 3 * 200 / (3 * 3 * 200 + 9 * 20)  # 3 long documents, repeated 3 times
    assert abs(long_tokens / tokens[2] - expected_long) < 0.01


def _appearances(stream: SourceStream, stop) -> tuple[list[int], dict]:
    """The documents a stream yields, in order, until ``stop(position)``; and that position."""
    order = []
    for position, item in stream.items(stream.start()):
        if stop(position):
            return order, position
        order.append(_origin(item)[1])
    raise AssertionError("unreachable: streams are infinite")


def test_upsampling_counts_are_exact_per_pass_and_rank(tmp_path):
    """Long documents early in the source: every copy lands within the first pass, so one pass
    holds each long document exactly upsample_factor times and each short one once; the dp
    ranks share out the documents, copies included, and no occurrence follows another of its
    own document."""
    lengths = [60 if i % 3 == 0 and i < 30 else 10 for i in range(80)]
    path = _write_source(tmp_path / "a.jsonl", 1, lengths)
    source = DataSource(str(path), upsample_min_tokens=60, upsample_factor=3)
    assert 30 // 2 + COPY_SPREAD * 2 + 1 < 80 // 2  # the last copies are due inside the pass
    seen = collections.Counter()
    for rank in range(2):
        stream = _stream(path, source, rank=rank, world=2)
        order, _ = _appearances(stream, lambda position: position["epoch"] == 1)
        assert {doc % 2 for doc in order} == {rank}
        assert all(a != b for a, b in zip(order, order[1:]))
        seen.update(order)
    assert seen == {doc: 3 if length >= 60 else 1 for doc, length in enumerate(lengths)}
    every_long = _stream(path, DataSource(str(path), upsample_min_tokens=1, upsample_factor=5))
    items = every_long.items(every_long.start())
    order = [_origin(item)[1] for _, item in itertools.islice(items, 2000)]
    assert all(a != b for a, b in zip(order, order[1:]))


def test_copies_carry_over_into_the_next_pass(tmp_path):
    """Long documents at the end of the source: their copies come during the next pass. Cut
    where no copy is waiting, every document has appeared (its passes begun) x its copies."""
    lengths = [10] * 27 + [50, 50, 50]
    path = _write_source(tmp_path / "a.jsonl", 1, lengths)
    stream = _stream(path, DataSource(str(path), upsample_min_tokens=50, upsample_factor=4))
    order, cut = _appearances(
        stream, lambda position: position["epoch"] == 2 and not position["copies"]
    )
    assert 0 < cut["document"] < 30
    counts = collections.Counter(order)
    for doc, length in enumerate(lengths):
        passes = 2 + (doc < cut["document"])
        assert counts[doc] == passes * (4 if length >= 50 else 1), doc
    second_pass = order.index(0, 1)
    assert order[:second_pass].count(29) == 1  # its copies all came in the second pass


def test_mixture_is_deterministic_and_seeded(tmp_path):
    lengths = [60 if i % 2 and i < 16 else 10 for i in range(40)]  # copies due inside a pass
    path = _write_source(tmp_path / "a.jsonl", 1, lengths)
    other = _write_source(tmp_path / "b.jsonl", 2, [15] * 10)
    sources = [
        DataSource(str(path), weight=2.0, upsample_min_tokens=60, upsample_factor=3),
        DataSource(str(other)),
    ]
    runs = {
        name: [b for b in itertools.islice(_loader(sources, seed=seed), 40)]
        for name, seed in (("a", 0), ("again", 0), ("other seed", 1))
    }
    assert all(_batches_equal(x, y) for x, y in zip(runs["a"], runs["again"]))
    assert not all(_batches_equal(x, y) for x, y in zip(runs["a"], runs["other seed"]))
    passes = {}
    for seed in (0, 1):
        stream = _stream(path, sources[0], seed=seed)
        order, _ = _appearances(stream, lambda position: position["epoch"] == 1)
        passes[seed] = order
    assert passes[0] != passes[1]
    assert collections.Counter(passes[0]) == collections.Counter(passes[1])


# --- resume ---------------------------------------------------------------------------------------


def test_resume_equals_the_uninterrupted_run(tmp_path):
    """From the state after any batch (mid-document, copies waiting, a source starting its next
    pass), a new loader yields exactly the batches the uninterrupted one did; it tokenizes one
    document per source to get there."""
    sources = [
        DataSource(str(_write_source(tmp_path / "a.jsonl", 1, [6 + i % 7 for i in range(25)]))),
        DataSource(
            str(
                _write_source(tmp_path / "b.jsonl", 2, [90 if i % 3 == 1 else 12 for i in range(9)])
            ),
            weight=2.0,
            upsample_min_tokens=90,
            upsample_factor=3,
        ),
        DataSource(str(_write_source(tmp_path / "c.jsonl", 3, [30] * 5)), weight=0.5),
    ]
    geometry = dict(seq_len=23, batch_size=2, dp_rank=1, dp_world_size=2, seed=7)
    reference = _loader(sources, **geometry)
    batches, states = [], [pickle.loads(pickle.dumps(reference.state_dict()))]
    for batch in itertools.islice(reference, 60):
        batches.append(batch)
        states.append(pickle.loads(pickle.dumps(reference.state_dict())))
    waiting = [k for k, s in enumerate(states) if s["sources"][1].get("copies")]
    middle = [k for k, s in enumerate(states) if s["offset"] > 0]
    wraps = [
        k
        for k in range(60)
        if states[k]["sources"][0]["epoch"] < states[k + 1]["sources"][0]["epoch"]
    ]
    assert waiting and middle and wraps  # the cuts below cover each case
    for k in sorted({0, 1, waiting[0], waiting[-1], middle[0], wraps[0], wraps[0] + 1, 45}):
        words = _Words()
        resumed = _loader(sources, words, **geometry)
        resumed.load_state_dict(states[k])
        position = resumed.stream.position_in(states[k])
        next(resumed.stream.items(position))
        assert words.calls == len(sources), "resume tokenized documents before the position"
        for i, batch in enumerate(itertools.islice(resumed, 60 - k)):
            assert _batches_equal(batch, batches[k + i]), (k, i)
    with pytest.raises(
        ValueError, match=r"saved reading a mixture of 3 sources, but this job mixes 2"
    ):
        _loader(sources[:2], **geometry).load_state_dict(states[5])
    with pytest.raises(
        ValueError, match=r"saved by a mixture of 3 sources, but this job reads one"
    ):
        _loader(sources[:1], **geometry).load_state_dict(states[5])


# --- configuration errors -------------------------------------------------------------------------


def _job(tmp_path: Path, body: str, *overrides: str):
    (tmp_path / "data.jsonl").write_text('{"text": "a document"}\n')
    job = tmp_path / "job.toml"
    job.write_text(f'extends = "{DEBUG_RECIPE}"\n{body}')
    return load_config(str(job), list(overrides))


GOOD = '[[training.sources]]\npath = "{data}"\n'
SOURCE_ERRORS = [
    ('[[training.sources]]\npath = "nowhere"\n', [], r"#1 path = 'nowhere' does not exist; point"),
    ("[[training.sources]]\nweight = 2.0\n", [], r"#1 has no path; add path = "),
    (
        GOOD * 2 + "weight = 0.0\n",
        [],
        r"#2 weight = 0.0 must be a finite number > 0: .*e\.g\. 1\.0",
    ),
    (GOOD + "weight = nan\n", [], r"#1 weight = nan must be a finite number > 0"),
    (GOOD + "upsample_factor = 0\n", [], r"#1 upsample_factor = 0 must be >= 1 \(1: no upsampling"),
    (GOOD + "upsample_min_tokens = -1\n", [], r"#1 upsample_min_tokens = -1 must be >= 0"),
    (GOOD + "upsample_factor = 2\n", [], r"#1 upsample_factor = 2 .*upsample_min_tokens = 0 makes"),
    (
        '[training]\ndataset_path = "{data}"\n' + GOOD,
        [],
        r"^job.toml: \[training\] dataset_path = .* and \[\[training.sources\]\] both name",
    ),
    (
        GOOD,
        ["--training.dataset_path", "{data}"],
        r"^command line and job.toml: \[training\] dataset_path = .* both name the training data",
    ),
    (
        GOOD,
        ["--training.dataset", "org/corpus"],
        r"are local files, but \[training\] dataset = 'org/corpus' names a Hugging Face dataset",
    ),
]


@pytest.mark.parametrize(("body", "overrides", "message"), SOURCE_ERRORS)
def test_bad_sources_are_one_clear_line(tmp_path, monkeypatch, body, overrides, message):
    monkeypatch.chdir(tmp_path)  # messages name job.toml as written
    data = str(tmp_path / "data.jsonl")
    overrides = [o.replace("{data}", data) for o in overrides]
    config = _job(tmp_path, body.replace("{data}", data), *overrides)
    with pytest.raises(ConfigError) as caught:
        check_training_data(config)
    text = str(caught.value)
    assert re.search(message, text) and "\n" not in text, text
    assert text.startswith(("job.toml", "command line")), text


TABLE_ERRORS = [
    (
        '[[training.sources]]\npth = "x"\n',
        [],
        r"^job.toml: unknown key \[\[training.sources\]\] #1 pth; known keys of "
        r"\[\[training.sources\]\]: "
        r"\['path', 'upsample_factor', 'upsample_min_tokens', 'weight'\]$",
    ),
    (
        '[[training.sources]]\npath = "x"\nweight = "2"\n',
        [],
        r"^job.toml: \[\[training.sources\]\] #1 weight = '2' should be of type float; write it "
        r"without quotes$",
    ),
    (
        '[[training.sources]]\npath = "x"\nupsample_factor = 1.5\n',
        [],
        r"#1 upsample_factor = 1.5 should be of type int$",
    ),
    (
        '[training]\nsources = "x"\n',
        [],
        r"^job.toml: \[training\] sources = 'x' should be \[\[training.sources\]\] tables",
    ),
    (
        "",
        ["--training.sources", "x"],
        r"^command line: --training.sources takes \[\[training.sources\]\] tables, which only a "
        r"job file can hold",
    ),
]


@pytest.mark.parametrize(("body", "overrides", "message"), TABLE_ERRORS)
def test_bad_tables_fail_while_loading(tmp_path, monkeypatch, body, overrides, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message):
        _job(tmp_path, body, *overrides)


def test_check_job_checks_sources_and_a_base_files_dataset_path_is_overridden(
    tmp_path, monkeypatch
):
    """The debug recipe sets dataset_path; a file extending it with sources trains on them."""
    monkeypatch.chdir(REPO)
    data = tmp_path / "data.jsonl"
    config = _job(tmp_path, GOOD.replace("{data}", str(data)))
    assert check_job(config, 2) == 1
    assert [s.path for s in config.training.data_sources] == [str(data)]
    bad = _job(tmp_path, GOOD.replace("{data}", str(data)) + "upsample_factor = 0\n")
    with pytest.raises(ConfigError, match=r"#1 upsample_factor = 0 must be >= 1"):
        check_job(bad, 2)
    assert load_config(str(DEBUG_RECIPE)).training.data_sources == [DataSource("assets/corpus")]


# --- data_report ----------------------------------------------------------------------------------


def test_report_numbers_equal_a_direct_count(tmp_path, capsys):
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()
    texts = {
        "web.jsonl": [" ".join(words[: 3 + i % 12]) for i in range(9)],
        "books.txt": [" ".join(words * (1 + 3 * i)) for i in range(6)],
    }
    (tmp_path / "web.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in texts["web.jsonl"])
    )
    (tmp_path / "books.txt").write_text("\f".join(texts["books.txt"]))
    job = tmp_path / "job.toml"
    job.write_text(
        f'extends = "{DEBUG_RECIPE}"\n[job]\ndump_folder = "{tmp_path / "out"}"\n'
        f'[model]\ntokenizer_path = "{REPO / "assets" / "tokenizer"}"\n'
        f'[[training.sources]]\npath = "{tmp_path / "web.jsonl"}"\nweight = 3.0\n'
        f'[[training.sources]]\npath = "{tmp_path / "books.txt"}"\nweight = 1.0\n'
        "upsample_min_tokens = 100\nupsample_factor = 4\n"
    )
    assert report.main(["--config", str(job)]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.splitlines()[-1])

    tokenizer = build_tokenizer(str(REPO / "assets" / "tokenizer"))
    shares, factors = {"web.jsonl": 0.75, "books.txt": 0.25}, {"web.jsonl": 1, "books.txt": 4}
    lengths = {name: [len(tokenizer.encode(t)) + 2 for t in docs] for name, docs in texts.items()}
    copies = {n: [factors[n] if x >= 100 else 1 for x in lengths[n]] for n in lengths}
    upsampled = {n: sum(x * c for x, c in zip(lengths[n], copies[n])) for n in lengths}
    for row, name in zip(result["sources"], texts):
        assert row["path"] == str(tmp_path / name)
        assert row["documents"] == len(texts[name])
        assert row["tokens"] == sum(lengths[name])
        assert row["long_documents"] == sum(c > 1 for c in copies[name])
        assert row["upsampled_tokens"] == upsampled[name]
        assert row["share"] == shares[name]
        assert row["mixture_tokens_per_pass"] == round(upsampled[name] / shares[name])
    assert (
        result["sources"][1]["long_documents"] >= 2 and result["sources"][0]["long_documents"] == 0
    )
    bins = collections.defaultdict(lambda: [0, 0, 0, 0.0])
    for name in texts:
        for x, c in zip(lengths[name], copies[name]):
            counts = bins[2 ** int(math.log2(x))]
            counts[0] += 1
            counts[1] += c
            counts[2] += x
            counts[3] += shares[name] * x * c / upsampled[name]
    every = {row["lengths"]: row for row in result["lengths"]}
    data_tokens = sum(map(sum, lengths.values()))
    for low, (documents, appearances, tokens, mixture) in bins.items():
        row = every.pop(f"{low}-{2 * low - 1}")
        assert (row["documents"], row["appearances"], row["tokens"]) == (
            documents,
            appearances,
            tokens,
        )
        assert row["data_share"] == pytest.approx(tokens / data_tokens)
        assert row["mixture_share"] == pytest.approx(mixture)
    assert all(row["documents"] == 0 for row in every.values())  # the empty bins in between
    png = tmp_path / "out" / "data_report.png"
    assert result["png"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"{sum(lengths['books.txt']):,}" in out  # the table shows the same numbers

    assert report.main(["--config", str(job)]) == 2
    assert "data_report.png already exists; pass --overwrite" in capsys.readouterr().err
