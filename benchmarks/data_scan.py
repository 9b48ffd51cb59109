"""Training data at scale, text against a token folder, side by side in one run: what a job's
start-up costs, how many tokens per second one rank's loader delivers, what a resume costs, and
the one-time cost of tokenizing.

    python benchmarks/data_scan.py                       # 1 GiB of text in /tmp/upipe_data_bench
    python benchmarks/data_scan.py --gib 0.05 --seconds 5  # a quick look

The corpus is generated here, never downloaded: documents of 1 to 80 paragraphs drawn at random
from the shipped corpus (assets/corpus), so every document differs and their lengths vary, as
``.jsonl`` files of about 128 MiB, until the text reaches ``--gib``. It is kept in ``--folder``
for the next run (with its token folder), never in the repository. The tokenizer is the shipped
one (assets/tokenizer). Measured for each path, with the code a training job runs:

- **data check**: what the trainer does before any process group (``data.checks.scan_sources``:
  every record parsed and every file hashed, or a token folder's manifest read) plus the
  start-up warnings' token count (``data.startup_warnings.source_tokens``: a sample tokenized,
  or the manifest's count);
- **loader and first batch**: ``PackedTextLoader`` built, its first document checked, its first
  batch of ``--seq-len`` tokens;
- **tokens/s per rank**: batches for ``--seconds``, by the loader of dp rank 0 of 1 and of dp
  rank 0 of ``--dp`` (every CP rank of a dp rank runs the same loader, so this is each GPU's
  data rate);
- **resume halfway**: a snapshot's data check (``data.checks.read_change``: the documents read
  so far re-read and hashed, or the token folder's hash compared) plus the first batch from the
  saved position (re-reading the documents before it, or indexing).

The last stdout line is JSON with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from upipe_dtensor.data.checks import read_change, scan_sources
from upipe_dtensor.data.loader import (
    LocalDocuments,
    PackedTextLoader,
    build_tokenizer,
    documents_digest,
)
from upipe_dtensor.data.startup_warnings import source_tokens
from upipe_dtensor.data.token_files import TokenFolder, is_token_folder
from upipe_dtensor.data.tokenize import tokenize

REPO = Path(__file__).resolve().parents[1]
FILE_BYTES = 128 * 2**20


def write_corpus(folder: Path, gib: float, seed: int = 0) -> int:
    """Documents of 1 to 80 paragraphs of the shipped corpus, as .jsonl files; returns the
    characters of text written (kept: a folder holding ``done`` is reused)."""
    done = folder / "done"
    if done.is_file():
        return int(done.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    paragraphs = [
        part.strip()
        for text in LocalDocuments(str(REPO / "assets" / "corpus"), "text")
        for part in text.split("\n\n")
        if part.strip()
    ]
    draw = random.Random(seed)
    target, characters, number = int(gib * 2**30), 0, 0
    while characters < target:
        with (folder / f"part-{number:03d}.jsonl").open("w") as handle:
            while handle.tell() < FILE_BYTES and characters < target:
                text = "\n\n".join(draw.choices(paragraphs, k=draw.randint(1, 80)))
                handle.write(json.dumps({"text": text}) + "\n")
                characters += len(text)
        number += 1
    done.write_text(str(characters))
    return characters


def _loader(path: str, tokenizer, seq_len: int, dp: int) -> PackedTextLoader:
    return PackedTextLoader(
        dataset="local",
        dataset_path=path,
        text_field="text",
        tokenizer=tokenizer,
        seq_len=seq_len,
        batch_size=1,
        dp_rank=0,
        dp_world_size=dp,
    )


def _timed(work):
    began = time.perf_counter()
    result = work()
    return time.perf_counter() - began, result


def tokens_per_second(path: str, tokenizer, seq_len: int, dp: int, seconds: float) -> float:
    """Tokens one rank's loader delivers per second (after its first batch)."""
    batches = iter(_loader(path, tokenizer, seq_len, dp))
    next(batches)
    count, began = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - began) < seconds or count < 2:
        next(batches)
        count += 1
    return count * seq_len / elapsed


def measure(path: str, tokenizer, args) -> dict[str, float]:
    """One path's numbers (see the module docstring)."""
    scan_s, scan = _timed(lambda: scan_sources([path], "text"))
    count_s, _ = _timed(lambda: source_tokens(scan.sources[0], tokenizer))

    def first_batch():
        loader = _loader(path, tokenizer, args.seq_len, 1)
        loader.check_first_document()
        return next(iter(loader))

    first_s, _ = _timed(first_batch)
    rates = {
        dp: tokens_per_second(path, tokenizer, args.seq_len, dp, args.seconds)
        for dp in (1, args.dp)
    }
    half = scan.sources[0].documents // 2
    position = {"epoch": 0, "document": half, "offset": 0, "dp_rank": 0, "dp_world_size": 1}
    if is_token_folder(path):
        documents = TokenFolder.open(path)
        saved = {"epoch": 0, "documents": half, "content_sha256": documents.content_sha256}
    else:
        documents = LocalDocuments(path, "text")
        saved = {"epoch": 0, "documents": half, "sha256": documents_digest(documents, half)[1]}

    def resume():
        assert read_change(saved, documents) == ""
        loader = _loader(path, tokenizer, args.seq_len, 1)
        loader.load_state_dict(position)
        return next(iter(loader))

    resume_s, _ = _timed(resume)
    return {
        "data_check_s": scan_s + count_s,
        "first_batch_s": first_s,
        "startup_s": scan_s + count_s + first_s,
        "tokens_per_s_dp1": rates[1],
        f"tokens_per_s_dp{args.dp}": rates[args.dp],
        "resume_halfway_s": resume_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--folder", default="/tmp/upipe_data_bench", help="corpus and tokens")
    parser.add_argument("--gib", type=float, default=1.0, help="text to generate, GiB")
    parser.add_argument("--seq-len", type=int, default=2**20, help="tokens per sequence")
    parser.add_argument("--dp", type=int, default=8, help="the second dp degree measured")
    parser.add_argument("--seconds", type=float, default=30.0, help="per tokens/s measurement")
    parser.add_argument("--workers", type=int, default=0, help="tokenize's (0: every CPU)")
    args = parser.parse_args()
    folder = Path(args.folder)
    text, tokens = folder / f"text-{args.gib:g}GiB", folder / f"tokens-{args.gib:g}GiB"
    write_s, characters = _timed(lambda: write_corpus(text, args.gib))
    text_bytes = sum(p.stat().st_size for p in text.glob("*.jsonl"))
    gib = text_bytes / 2**30
    print(f"corpus {text}: {characters / 1e9:.3f} G characters, {gib:.2f} GiB of jsonl")
    tokenizer = build_tokenizer(str(REPO / "assets" / "tokenizer"))
    tokenize_s = None
    if not is_token_folder(tokens):
        tokenize_s, _ = _timed(
            lambda: tokenize(
                str(REPO / "train_configs" / "debug_model.toml"),
                ["--training.dataset_path", str(text)],
                str(tokens),
                workers=args.workers,
            )
        )
    manifest = TokenFolder.open(str(tokens)).manifest
    load = os.getloadavg()[0]
    results = {path.name: measure(str(path), tokenizer, args) for path in (text, tokens)}
    rows = [
        ("data check before the process group, s", "data_check_s", "{:.3f}"),
        ("loader built + first batch, s", "first_batch_s", "{:.3f}"),
        ("start-up total, s", "startup_s", "{:.3f}"),
        ("tokens/s per rank, dp 1", "tokens_per_s_dp1", "{:,.0f}"),
        (f"tokens/s per rank, rank 0 of dp {args.dp}", f"tokens_per_s_dp{args.dp}", "{:,.0f}"),
        ("resume halfway (data check + first batch), s", "resume_halfway_s", "{:.3f}"),
    ]
    print(
        f"\n{manifest['documents']:,} documents, {manifest['tokens']:,} tokens "
        f"({manifest['dtype']}), seq_len {args.seq_len:,}, load average {load:.1f} on "
        f"{os.cpu_count()} CPUs\n"
    )
    print("| | text (.jsonl) | token folder | text / token folder |\n|---|---:|---:|---:|")
    for label, key, form in rows:
        a, b = results[text.name][key], results[tokens.name][key]
        print(f"| {label} | {form.format(a)} | {form.format(b)} | {a / b:,.3g} |")
    if tokenize_s is not None:
        print(
            f"\none-time tokenize ({args.workers or len(os.sched_getaffinity(0))} workers): "
            f"{tokenize_s:.0f} s, {characters / 1e6 / tokenize_s:.2f} M characters/s, "
            f"{manifest['tokens'] / tokenize_s:,.0f} tokens/s"
        )
    print(
        json.dumps(
            {
                "characters": characters,
                "jsonl_bytes": text_bytes,
                "documents": manifest["documents"],
                "tokens": manifest["tokens"],
                "seq_len": args.seq_len,
                "load_average": load,
                "corpus_write_s": write_s,
                "tokenize_s": tokenize_s,
                "text": results[text.name],
                "token_folder": results[tokens.name],
            }
        )
    )


if __name__ == "__main__":
    main()
