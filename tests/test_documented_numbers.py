"""Every measured number in the README and the docs reproduces from its command.

A measured (or computed) number group carries a note "measured with `COMMAND` at COMMIT"
(README.md, "Development"). Here: every note names a command that exists and a commit of this
repository; the README's headline ratios are the docs' tables'; the commands that take seconds are
re-run and their tables compared with the docs; the benchmarks that take minutes (one attention
layer in every CP style, one training step per memory-stack switch) are re-run with ``--slow``.
A documented number that drifts fails here, naming the command that re-measures it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NOTE = re.compile(
    r"(?:[Mm]easured|[Cc]omputed|[Pp]lanned) with\s+`([^`]+)`\s+at\s+([0-9a-f]{7,40})\b", re.S
)


def _notes() -> list[tuple[Path, str, str]]:
    """(document, command, commit) of every note, a command's line breaks joined."""
    return [
        (doc, " ".join(command.split()), commit)
        for doc in DOCS
        for command, commit in NOTE.findall(doc.read_text())
    ]


def _table_after(text: str, command: str) -> list[list[str]]:
    """The cells of the first markdown table after the note naming ``command``."""
    note = next(m for m in NOTE.finditer(text) if " ".join(m.group(1).split()) == command)
    rows = []
    for line in text[note.end() :].splitlines():
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows


def _block_after(text: str, command: str) -> list[str]:
    """The lines of the first fenced block after the note naming ``command``."""
    note = next(m for m in NOTE.finditer(text) if " ".join(m.group(1).split()) == command)
    block = text[note.end() :].split("```", 2)[1]
    return block.split("\n", 1)[1].rstrip("\n").splitlines()


def _cells(markdown: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in markdown.splitlines()
    ]


def _run(*command: str) -> str:
    done = subprocess.run(
        [sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _benchmark(name: str):
    """A benchmarks/ script as a module (they import their sibling ``live_memory``)."""
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_note_names_a_command_that_exists_and_a_commit() -> None:
    notes = _notes()
    documented = {(doc.name, command) for doc, command, _ in notes}
    for expected in [
        ("README.md", "python benchmarks/attention_memory.py"),
        ("README.md", "python benchmarks/memory_stack.py"),
        ("README.md", "bash .ci/run"),
        ("memory-stack.md", "python benchmarks/attention_memory.py"),
        ("memory-stack.md", "python benchmarks/memory_stack.py"),
        ("memory-stack.md", "python benchmarks/peer_attention.py"),
        ("README.md", "python benchmarks/peer_attention.py"),
        ("design.md", "python benchmarks/communication_volume.py"),
        ("troubleshooting.md", "python benchmarks/data_scan.py"),
        (
            "README.md",
            "torchrun --nproc_per_node 2 train.py --config train_configs/debug_model.toml",
        ),
        ("context-extension.md", "bash scripts/passkey_example.sh"),
    ]:
        assert expected in documented, f"{expected[0]} names no measurement by {expected[1]}"
    git = shutil.which("git") and (REPO / ".git").exists()
    shallow = (
        git
        and subprocess.run(
            ["git", "rev-parse", "--is-shallow-repository"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
        == "true"
    )
    for doc, command, commit in notes:
        words = command.split()
        program = next(
            w for w in [*words, words[-1]] if w.endswith((".py", ".sh", "/run")) or w == words[-1]
        )
        if words[:2] == ["python", "-m"] and words[2].startswith("upipe_dtensor."):
            assert importlib.util.find_spec(words[2]), f"{doc.name}: {command}: no {words[2]}"
        else:
            assert (REPO / program).is_file(), f"{doc.name}: {command}: no {program}"
        if git and not shallow:
            known = subprocess.run(
                ["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO, capture_output=True
            )
            assert known.returncode == 0, f"{doc.name}: {command} at {commit}: no such commit"


def test_the_readme_headline_ratios_are_the_docs_tables() -> None:
    memory = (REPO / "docs/memory-stack.md").read_text()
    attention = {
        row[0]: row for row in _table_after(memory, "python benchmarks/attention_memory.py")
    }
    step = {row[0]: row for row in _table_after(memory, "python benchmarks/memory_stack.py")}
    upipe = re.search(r"\((\d\.\d\d)x\)", attention["UPipe, U = C = 4"][5]).group(1)
    both = re.search(r"\((\d\.\d\d)x\)", attention["UPipe x FPDT, U = C, 4 chunks"][5]).group(1)
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"UPipe with U = C needs {upipe}x Ulysses' backward working memory" in readme
    assert f"UPipe x FPDT with 4 chunks {both}x" in readme
    assert f"brings the peak to {step['all'][2]}x the plain step's" in readme


def test_the_peer_tables_are_the_stored_report_and_the_readme_quotes_them(capsys) -> None:
    """docs/memory-stack.md's tables against DeepSpeed's Ulysses are what ``peer_attention.py
    --table`` prints from the stored report, and the README's ratios at Llama3-8B's heads and
    with MHA are that report's."""
    sys.path.insert(0, str(BENCHMARKS))
    # Imported by name, not loaded again from its file: test_peer_memory.py's gloo ranks pickle
    # the functions of the module that sys.modules holds.
    bench = importlib.import_module("peer_attention")
    stored = json.loads((BENCHMARKS / "results/peer_attention.json").read_text())
    bench.print_tables(stored)
    printed = capsys.readouterr().out
    memory = (REPO / "docs/memory-stack.md").read_text()
    tables = [t for t in printed.split("\n\n") if t.startswith("|")]
    assert len(tables) == len(stored) >= 3
    for table in tables:
        assert table.strip() in memory, "paste `peer_attention.py --table` into memory-stack.md"

    def ratio(geometry: tuple[int, int, int, int], row: str, mode: str) -> str:
        (result,) = [r for r in stored if tuple(r["geometry"].values()) == geometry]
        peaks = {r["row"]["name"]: r["peaks"] for r in result["rows"]}
        return f"{peaks[row][mode] / peaks['DeepSpeed Ulysses'][mode]:.2f}x"

    llama, mha, gqa_long = (32, 8, 128, 8192), (32, 32, 16, 16384), (32, 8, 16, 16384)
    readme = " ".join((REPO / "README.md").read_text().split())
    ulysses, upipe = "ours: Ulysses", "ours: UPipe, U = C"
    claims = [
        f"this project's Ulysses {ratio(llama, ulysses, 'plain')}",
        f"UPipe with U = C {ratio(llama, upipe, 'plain')} ({ratio(llama, upipe, 'ckpt')} "
        "checkpointed)",
        f"with frozen weights {ratio(llama, upipe, 'plain frozen')} and "
        f"{ratio(llama, upipe, 'ckpt frozen')}",
        f"UPipe needs {ratio(mha, upipe, 'plain')} ({ratio(mha, upipe, 'ckpt')} checkpointed)",
        f"context, {ratio(gqa_long, upipe, 'plain')} ({ratio(gqa_long, upipe, 'ckpt')} "
        "checkpointed:",
    ]
    for claim in claims:
        assert claim in readme, f"README: {claim!r} (benchmarks/results/peer_attention.json)"


def test_the_benchmark_rows_run_the_style_they_name() -> None:
    """The rows labelled UPipe x FPDT once ran plain FPDT ('fpdt' was tested for first)."""
    from upipe_dtensor.parallel.style import (
        FPDTAttention,
        RingAttention,
        UPipeAttention,
        UPipeFPDTAttention,
    )

    bench = _benchmark("attention_memory")
    config = bench.Config(4, 8192, 1, 32, 8, 64, "float32", bench.default_variants(4, 32, [4], [4]))
    styles = {v.name: bench.make_style(config, v) for v in config.variants}
    both = styles["UPipe x FPDT, U = C, 4 chunks"]
    assert type(both) is UPipeFPDTAttention and both.chunk_tokens == 2048
    assert type(styles["FPDT, 4 chunks"]) is FPDTAttention
    assert type(styles["ring attention"]) is RingAttention
    assert (
        type(styles["UPipe, U = C = 4"]) is UPipeAttention
        and styles["UPipe, U = C = 4"].chunk_tokens is None
    )


def test_the_paper_table_reproduces_and_its_band_holds_30_of_37(capsys, monkeypatch) -> None:
    """docs/measurements.md's summary of the paper table is what the stored counted work prices
    to today, and the band holds the paper's measurement in at least 30 of its 37 cells (the
    central value is fitted to none of them)."""
    monkeypatch.chdir(REPO)
    _benchmark("paper_throughput").main(["--table", "benchmarks/results/paper_throughput.json"])
    summary = re.search(
        r"(\d+) cells; inside the band: (\d+) of \d+;[^\n]*", capsys.readouterr().out
    )
    assert summary and int(summary[1]) == 37 and int(summary[2]) >= 30, summary
    assert summary[0] in (REPO / "docs/measurements.md").read_text(), (
        "re-run `python benchmarks/paper_throughput.py --table "
        "benchmarks/results/paper_throughput.json` and paste its table into docs/measurements.md"
    )


def test_fast_documented_outputs_reproduce(tmp_path: Path, capsys, monkeypatch) -> None:
    """The commands that take seconds, re-run in this process: their output is the docs'."""
    monkeypatch.chdir(REPO)  # the docs' commands run from the repository root
    design = (REPO / "docs/design.md").read_text()
    command = "python benchmarks/communication_volume.py"
    _benchmark("communication_volume").main()
    assert _cells(capsys.readouterr().out.strip()) == _table_after(design, command), (
        f"docs/design.md's table is not what `{command}` prints today: re-run it and paste"
    )

    # docs/training.md's mixture report, from its own mixture.toml (the tables: the file and PNG
    # names differ here)
    from upipe_dtensor.data.report import main as data_report

    training = (REPO / "docs/training.md").read_text()
    toml = training.split("```toml\n", 1)[1].split("```", 1)[0]
    job = tmp_path / "mixture.toml"
    job.write_text(toml.replace('"train_configs/', f'"{REPO}/train_configs/'))
    assert data_report(["--config", str(job), "--png", str(tmp_path / "m.png")]) == 0
    command = "python -m upipe_dtensor.data_report --config mixture.toml"
    documented = _block_after(training, command)
    tables = [line for line in documented[1:] if not line.startswith(("wrote", "{", " "))]
    out = capsys.readouterr().out.splitlines()
    assert out[1 : 1 + len(tables)] == tables, f"re-run `{command}` and paste its output"


@pytest.mark.slow
def test_attention_memory_table_reproduces() -> None:
    """About 5 minutes on 2 cores (4 gloo ranks, S = 16384, every CP style, profiled)."""
    bench = _benchmark("attention_memory")
    report = json.loads(_run("benchmarks/attention_memory.py", "--json"))
    fresh = _cells(bench.markdown_table(*bench.rows_from_json(report)))
    documented = _table_after(
        (REPO / "docs/memory-stack.md").read_text(), "python benchmarks/attention_memory.py"
    )
    assert fresh == documented, "re-measure docs/memory-stack.md (and the README's ratios)"


@pytest.mark.slow
def test_memory_stack_table_reproduces() -> None:
    """About 10 minutes on 2 cores (the debug model's step, 2 gloo ranks, every switch)."""
    bench = _benchmark("memory_stack")
    report = json.loads(_run("benchmarks/memory_stack.py", "--json"))
    fresh = _cells(bench.markdown_table([bench.Row(**row) for row in report["rows"]]))
    documented = _table_after(
        (REPO / "docs/memory-stack.md").read_text(), "python benchmarks/memory_stack.py"
    )
    assert fresh == documented, "re-measure docs/memory-stack.md (and the README's ratio)"
