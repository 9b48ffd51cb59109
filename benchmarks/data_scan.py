"""How fast a job's start-up check reads its local data (``data.checks.scan_local_data``: every
record parsed, every file hashed), on a synthetic ``.jsonl`` written to a temporary folder.

Run: ``python benchmarks/data_scan.py`` (100,000 documents, about 190 MiB).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from upipe_dtensor.data.checks import scan_local_data

WORDS = "the of and to in is that for it as with was on be by this are or from".split()


def write_corpus(path: Path, documents: int, words: int, seed: int = 0) -> int:
    """``documents`` jsonl records of about ``words`` words each; returns the file's bytes."""
    rng = random.Random(seed)
    with path.open("w") as handle:
        for i in range(documents):
            text = " ".join(rng.choices(WORDS, k=rng.randint(words // 2, 3 * words // 2)))
            handle.write(json.dumps({"id": i, "text": text}) + "\n")
    return path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--words", type=int, default=500, help="mean words per document")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        corpus = Path(folder) / "corpus.jsonl"
        size = write_corpus(corpus, args.documents, args.words)
        began = time.perf_counter()
        scan = scan_local_data(str(corpus), "text")
        seconds = time.perf_counter() - began
    print(
        f"scanned {scan.records:,} records, {size / 2**20:.0f} MiB, in {seconds:.1f} s "
        f"({size / 2**20 / seconds:.0f} MiB/s)"
    )


if __name__ == "__main__":
    main()
