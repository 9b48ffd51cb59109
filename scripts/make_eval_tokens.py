"""Make the token file ``evaluate --tokens`` reads: held-out text -> an (N, S) int32 ``.npy``.

    python scripts/make_eval_tokens.py /data/held_out.jsonl eval_1M.npy --rows 4 \\
        --seq-len 1048576 --tokenizer /models/Llama-3.1-8B
    python scripts/make_eval_tokens.py assets/corpus eval_512.npy --rows 4 --seq-len 512

The text is read and tokenized as training reads it (``data.loader.PackedTextLoader``: a
.txt/.jsonl/.parquet file or a folder of them, ``--text-field`` naming the jsonl field or parquet
column, each document wrapped in BOS ... EOS and packed back to back), and the first N windows of
S tokens become the N rows. Use text the model did not train on, with documents longer than the
context you want to measure: the loss by position only shows the use of context that the
documents have. S must be divisible by the job's context-parallel degree. The data must hold the
N windows without repeating itself (an error says how many fit otherwise).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from upipe_dtensor.data.loader import PackedTextLoader, build_tokenizer


def token_rows(data: str, tokenizer: str, rows: int, seq_len: int, text_field: str) -> np.ndarray:
    """The first ``rows`` windows of ``seq_len`` packed tokens of ``data``; ValueError if the data
    runs out first (the loader would start it over)."""
    loader = PackedTextLoader(
        dataset="local",
        dataset_path=data,
        text_field=text_field,
        tokenizer=build_tokenizer(tokenizer),
        seq_len=seq_len,
        batch_size=1,
        dp_rank=0,
        dp_world_size=1,
    )
    batches, windows = iter(loader), []
    for _ in range(rows):
        inputs, _ = next(batches)
        if loader.read_state()["epoch"] > 0:
            raise ValueError(
                f"{data} holds {len(windows)} window(s) of {seq_len:,} tokens, fewer than "
                f"--rows {rows}: use fewer rows, a shorter --seq-len or more text"
            )
        windows.append(inputs[0].numpy())
    return np.stack(windows).astype(np.int32)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("data", help="a .txt/.jsonl/.parquet file or a folder of them")
    parser.add_argument("out", help="the .npy file to write (must not exist)")
    parser.add_argument("--rows", type=int, required=True, help="N, sequences to evaluate")
    parser.add_argument("--seq-len", type=int, required=True, help="S, tokens per sequence")
    parser.add_argument(
        "--tokenizer",
        default="assets/tokenizer",
        help="folder with the model's tokenizer.json (default: the shipped one)",
    )
    parser.add_argument("--text-field", default="text", help="jsonl field / parquet column")
    args = parser.parse_args(argv)
    if Path(args.out).exists():
        parser.error(f"{args.out} already exists; choose another name or move it away")
    if args.rows < 1 or args.seq_len < 2:
        parser.error("--rows must be >= 1 and --seq-len >= 2")
    try:
        tokens = token_rows(args.data, args.tokenizer, args.rows, args.seq_len, args.text_field)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    np.save(args.out, tokens)
    print(f"wrote {args.out}: {tokens.shape[0]} x {tokens.shape[1]:,} token ids ({tokens.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
