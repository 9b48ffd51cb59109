"""Tokenize a job's training text once, into a token folder that training maps instead of
tokenizing:

    python -m upipe_dtensor.tokenize --config job.toml --output data/tokens [--workers N]
    python -m upipe_dtensor.tokenize --config job.toml --output data/web --source 2
    torchrun ... train.py --config job.toml --training.dataset_path data/tokens

The text is the job's: ``[training] dataset_path`` (or one ``[[training.sources]]`` table's path,
``--source N``; or the Hugging Face dataset ``dataset`` with ``dataset_config_name`` and
``dataset_split``), read as training reads it (``dataset_text_field``; a bad record stops the
command naming its file and line, or is skipped and counted with ``skip_bad_records``), and the
tokenizer is the job's ``[model] tokenizer_path``. Each document is packed as training packs it,
``[BOS] + tokens + [EOS]``, so training on the folder gives exactly the batches training on the
text gives (``data.token_files`` describes the folder).

The reading and writing are one stream in this process and the tokenizing runs in ``--workers``
processes (default: every CPU this process may use), a bounded number of pieces of about
``BATCH_CHARACTERS`` in flight, so memory stays flat whatever the corpus size. The folder is
written under a hidden temporary name and renamed when complete; a failed or interrupted run
leaves nothing under the output's name. An existing non-empty output is refused unless
``--overwrite``. The last stdout line is JSON: the output, documents, tokens, dtype, seconds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from upipe_dtensor.checkpointing.outputs import kept_note, refuse_nonempty
from upipe_dtensor.config import OVERRIDES_HELP, ConfigError, JobConfig, parse_args
from upipe_dtensor.config.checks import DATA_KEYS, check_training_data, data_error
from upipe_dtensor.config.schema import source_label
from upipe_dtensor.data.checks import SHOWN
from upipe_dtensor.data.loader import (
    RECORD_FIX,
    HubDocuments,
    LocalDocuments,
    Record,
    Tokenizer,
    build_tokenizer,
    job_tokenizer,
)
from upipe_dtensor.data.mixture import pack_document
from upipe_dtensor.data.token_files import (
    TokenWriter,
    is_token_folder,
    token_dtype,
    tokenizer_identity,
)
from upipe_dtensor.runtime.errors import run_main

logger = logging.getLogger(__name__)

BATCH_CHARACTERS = 2**20
"""Text per piece handed to a worker: large enough that handing it over costs little against
tokenizing it (about a second of one core), small enough to keep memory flat."""
IN_FLIGHT_PER_WORKER = 2
"""Pieces queued per worker: one tokenizing, one waiting, so no worker idles while the reader
parses."""
PROGRESS_SECONDS = 30.0


def pack_texts(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, ...]:
    """The documents packed as the loader packs them (``mixture.pack_document``): their tokens
    back to back in ``dtype``, and each one's length."""
    packed = [pack_document(tokenizer, text) for text in texts]
    lengths = np.fromiter(map(len, packed), dtype=np.int64, count=len(packed))
    tokens = np.fromiter(itertools.chain.from_iterable(packed), dtype=dtype, count=lengths.sum())
    return tokens, lengths


_worker_tokenizer: Tokenizer | None = None


def _start_worker(tokenizer_folder: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(tokenizer_folder)


def _pack_in_worker(texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, ...]:
    return pack_texts(_worker_tokenizer, texts, dtype)


def _pieces(texts: Iterator[str]) -> Iterator[list[str]]:
    """The texts in order, grouped into pieces of about ``BATCH_CHARACTERS``."""
    piece, size = [], 0
    for text in texts:
        piece.append(text)
        size += len(text)
        if size >= BATCH_CHARACTERS:
            yield piece
            piece, size = [], 0
    if piece:
        yield piece


class RecordCounter:
    """The good texts of a record stream; a bad record stops it (naming it and the fix) or, with
    ``skip_bad``, is counted, the first ``SHOWN`` kept for the report."""

    def __init__(self, skip_bad: bool) -> None:
        self.skip_bad, self.bad, self.bad_count, self.characters = skip_bad, [], 0, 0

    def texts(self, records: Iterator[Record]) -> Iterator[str]:
        for record in records:
            if not record.problem:
                self.characters += len(record.text)
                yield record.text
                continue
            if not self.skip_bad:
                raise ValueError(f"{record.message}; {RECORD_FIX}")
            self.bad_count += 1
            if len(self.bad) < SHOWN:
                self.bad.append(record.message)


def _source(config: JobConfig, number: int | None) -> tuple[LocalDocuments | HubDocuments, dict]:
    """The documents to tokenize and how the manifest names them; ConfigError if the job's data
    is not one text source."""
    training = config.training
    where = config.source_of(*DATA_KEYS)
    if training.sources and number is None:
        raise ConfigError(
            f"{where}: [training] data is a mixture of {len(training.sources)} "
            "[[training.sources]]; a token folder holds one source: pass --source N (1 to "
            f"{len(training.sources)}) and write each one to its own --output"
        )
    if number is not None and not 1 <= number <= len(training.sources):
        raise ConfigError(
            f"--source {number}: the job has {len(training.sources)} [[training.sources]] "
            f"tables; pass one of 1 to {len(training.sources)}"
            + ("" if training.sources else " (without tables, leave --source out)")
        )
    try:
        if training.dataset != "local":
            documents: LocalDocuments | HubDocuments = HubDocuments(
                training.dataset,
                training.dataset_split,
                training.dataset_text_field,
                config_name=training.dataset_config_name,
            )
            named = {
                "dataset": training.dataset,
                "dataset_config_name": training.dataset_config_name,
                "dataset_split": training.dataset_split,
            }
        else:
            path = training.sources[number - 1].path if number else training.dataset_path
            key = f"{source_label(number)} path" if number else "dataset_path"
            if is_token_folder(path):
                raise ValueError(f"{key} {path!r} is a token folder already; train on it as it is")
            documents = LocalDocuments(path, training.dataset_text_field, key=key)
            named = {"dataset_path": path}
    except ValueError as err:
        raise data_error(config, str(err)) from err
    return documents, {**named, "text_field": training.dataset_text_field}


def _progress(started: float, writer: TokenWriter, characters: int) -> str:
    seconds = time.perf_counter() - started
    return (
        f"{writer.documents:,} documents, {writer.tokens:,} tokens, {characters / 1e6:,.1f} M "
        f"characters in {seconds:.0f} s ({characters / 1e6 / max(seconds, 1e-9):.2f} M "
        "characters/s)"
    )


def _write_pieces(
    pieces: Iterator[list[str]], writer: TokenWriter, tokenizer: Tokenizer, workers: int, report
) -> None:
    """Tokenize the pieces (in ``workers`` processes when more than one) and write them in
    order; ``report()`` is called after each piece."""
    if workers == 1:
        for piece in pieces:
            writer.write(*pack_texts(tokenizer, piece, writer.dtype))
            report()
        return
    # fork: the workers need none of the parent's state but the tokenizer folder, and a fresh
    # interpreter would import torch again (seconds) for nothing.
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(
        workers,
        mp_context=context,
        initializer=_start_worker,
        initargs=(tokenizer.tokenizer_path,),
    ) as pool:
        pending: deque[Future] = deque()
        try:
            for piece in pieces:
                pending.append(pool.submit(_pack_in_worker, piece, writer.dtype))
                if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                    writer.write(*pending.popleft().result())
                    report()
            while pending:
                writer.write(*pending.popleft().result())
                report()
        finally:
            pool.shutdown(cancel_futures=True)


def tokenize(
    config_file: str,
    overrides: list[str],
    output: str,
    *,
    source: int | None = None,
    workers: int = 0,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the job's text as a token folder at ``output``; returns the report's JSON fields."""
    config = parse_args(["--config", config_file, *overrides])
    check_training_data(config)
    folder = Path(output)
    if not overwrite:
        refuse_nonempty(folder, "pass --overwrite to replace its token files, or name another one")
    documents, named = _source(config, source)
    tokenizer = job_tokenizer(config)
    workers = workers or len(os.sched_getaffinity(0))  # the CPUs this process may run on
    counter = RecordCounter(config.training.skip_bad_records)
    started = last = time.perf_counter()
    writer = TokenWriter(folder, token_dtype(max(tokenizer.get_vocab().values()) + 1))

    def report() -> None:
        nonlocal last
        if time.perf_counter() - last >= PROGRESS_SECONDS:
            last = time.perf_counter()
            logger.info("tokenized %s", _progress(started, writer, counter.characters))

    try:
        try:
            texts = counter.texts(documents.records())
            _write_pieces(_pieces(texts), writer, tokenizer, workers, report)
        except ValueError as err:
            raise data_error(config, str(err)) from err
        if writer.documents == 0:
            raise data_error(
                config, f"{documents.description} holds no non-blank documents; nothing to tokenize"
            )
        record = {
            "tokenizer": tokenizer_identity(tokenizer),
            "source": {
                **named,
                "characters": counter.characters,
                "skipped_records": counter.bad_count,
                "first_skipped": counter.bad,
            },
            "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        kept = writer.publish(record, overwrite=overwrite)
    finally:
        writer.close()
    seconds = time.perf_counter() - started
    if counter.bad_count:
        logger.warning(
            "skipped %s bad records ([training] skip_bad_records = true): %s",
            f"{counter.bad_count:,}",
            "; ".join(counter.bad),
        )
    summary = _progress(started, writer, counter.characters)
    logger.info(
        "wrote %s%s: %s; %s tokens. Train on it with [training] dataset_path = '%s'",
        folder,
        kept_note(kept, "tokenize"),
        summary,
        writer.dtype.name,
        folder,
    )
    return {
        "output": str(folder),
        "documents": writer.documents,
        "tokens": writer.tokens,
        "dtype": writer.dtype.name,
        "characters": counter.characters,
        "seconds": round(seconds, 3),
        "workers": workers,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=OVERRIDES_HELP,
    )
    parser.add_argument("--config", required=True, help="job .toml whose data and tokenizer to use")
    parser.add_argument("--output", required=True, help="the token folder to write")
    parser.add_argument(
        "--source", type=int, help="with [[training.sources]]: the table (1, 2, ...) to tokenize"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="tokenizing processes (default 0: every CPU this process may use; 1: this process)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the token files of an existing folder"
    )
    args, overrides = parser.parse_known_args(argv)
    if args.workers < 0:
        parser.error(f"--workers {args.workers} must be >= 0 (0: every CPU)")

    def work() -> None:
        result = tokenize(
            args.config,
            overrides,
            args.output,
            source=args.source,
            workers=args.workers,
            overwrite=args.overwrite,
        )
        print(json.dumps(result), flush=True)  # the command's output: its result, one JSON line

    return run_main(work)
