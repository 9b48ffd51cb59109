"""The training data as the job will train on it, before training: is the mixture what you meant?

    python -m upipe_dtensor.data_report --config job.toml [--png out.png] [--overwrite]

Per source (the [[training.sources]] tables, or dataset_path as the one source): its weight and
share of the mixture's tokens (weight / sum of the weights), documents, long documents (those
upsampled), tokens before and after upsampling, and the mixture tokens per pass over the source
(how often it repeats). Then the documents by length in log-spaced bins (powers of two): how many,
how many appearances per pass (copies counted), and the share of the tokens they hold in the data
as it is and in the mixture as trained. A length counts a document's tokens plus BOS and EOS, as
they are packed; every document is read and tokenized once, in this one process (a token
folder's lengths come from its offsets).

The last stdout line is one JSON object: ``{"sources": [one object per source, the table's
columns], "lengths": [one object per bin], "png": path}``. The histogram (shares of tokens by
document length, data as it is beside the mixture as trained) goes to --png, by default
``[job] dump_folder/data_report.png``; an existing file is refused before any reading unless
``--overwrite``.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from upipe_dtensor.checkpointing.outputs import refuse_existing, writing_file
from upipe_dtensor.config import OVERRIDES_HELP, ConfigError, JobConfig, parse_args
from upipe_dtensor.config.checks import check_training_data, data_error
from upipe_dtensor.config.schema import DataSource, source_label
from upipe_dtensor.data.loader import LocalDocuments, Tokenizer, job_tokenizer
from upipe_dtensor.data.mixture import copies_of, pack_document
from upipe_dtensor.data.token_files import TokenFolder, is_token_folder
from upipe_dtensor.runtime.errors import run_main

logger = logging.getLogger(__name__)


@dataclass
class SourceLengths:
    """One source and the packed length of each of its documents, in order."""

    source: DataSource
    lengths: list[int]


def measure_sources(config: JobConfig, tokenizer: Tokenizer) -> list[SourceLengths]:
    """Every document of every source, read and tokenized as the loader does; ConfigError for a
    bad record (unless [training] skip_bad_records) or a source without documents."""
    training = config.training
    measured = []
    for number, source in enumerate(training.data_sources, 1):
        key = f"{source_label(number)} path" if training.sources else "dataset_path"
        try:
            if is_token_folder(source.path):  # its offsets give the lengths: nothing to tokenize
                documents = TokenFolder.open(source.path, key)
                documents.check_tokenizer(tokenizer)
                lengths = documents.lengths().tolist()
            else:
                documents = LocalDocuments(
                    source.path,
                    training.dataset_text_field,
                    skip_bad=training.skip_bad_records,
                    key=key,
                )
                lengths = [len(pack_document(tokenizer, text)) for text in documents]
        except ValueError as err:
            raise data_error(config, str(err)) from err
        if not lengths:
            raise data_error(
                config,
                f"{documents.description} holds no non-blank documents; add documents or remove "
                "the source",
            )
        measured.append(SourceLengths(source, lengths))
    return measured


def source_rows(measured: list[SourceLengths]) -> list[dict]:
    """Per source: documents, long documents, tokens before and after upsampling, its share of
    the mixture's tokens, and the mixture tokens after which it has been seen once."""
    total_weight = sum(m.source.weight for m in measured)
    rows = []
    for m in measured:
        copies = [copies_of(m.source, length) for length in m.lengths]
        upsampled = sum(length * count for length, count in zip(m.lengths, copies))
        share = m.source.weight / total_weight
        rows.append(
            {
                "path": m.source.path,
                "weight": m.source.weight,
                "share": share,
                "documents": len(m.lengths),
                "long_documents": sum(count > 1 for count in copies),
                "tokens": sum(m.lengths),
                "upsampled_tokens": upsampled,
                "mixture_tokens_per_pass": round(upsampled / share),
            }
        )
    return rows


def length_bins(measured: list[SourceLengths], rows: list[dict]) -> list[dict]:
    """Documents by packed length in bins [2^k, 2^(k+1)), every bin from the shortest document's
    to the longest's: documents, appearances per pass over their sources, tokens, and the share
    of tokens in the data as it is and in the mixture as trained (a source's upsampled tokens
    scaled to its share)."""
    bits = [length.bit_length() - 1 for m in measured for length in m.lengths]
    bins = {
        k: {"documents": 0, "appearances": 0, "tokens": 0, "mixture_share": 0.0}
        for k in range(min(bits), max(bits) + 1)
    }
    for m, row in zip(measured, rows):
        for length in m.lengths:
            count = copies_of(m.source, length)
            counts = bins[length.bit_length() - 1]
            counts["documents"] += 1
            counts["appearances"] += count
            counts["tokens"] += length
            counts["mixture_share"] += row["share"] * length * count / row["upsampled_tokens"]
    data_tokens = sum(row["tokens"] for row in rows)
    return [
        {
            "lengths": f"{2**k}-{2 ** (k + 1) - 1}",
            **{key: counts[key] for key in ("documents", "appearances", "tokens")},
            "data_share": counts["tokens"] / data_tokens,
            "mixture_share": counts["mixture_share"],
        }
        for k, counts in bins.items()
    ]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Columns padded to their widest cell: the first left-aligned, the numbers right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    return [
        "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths))
        ).rstrip()
        for line in (header, *rows)
    ]


def format_report(rows: list[dict], bins: list[dict]) -> list[str]:
    """The two tables, sources then lengths, as printed."""
    sources = _table(
        ["source", "weight", "share", "documents", "long", "tokens", "upsampled", "pass every"],
        [
            [
                row["path"],
                f"{row['weight']:g}",
                f"{row['share']:.1%}",
                f"{row['documents']:,}",
                f"{row['long_documents']:,}",
                f"{row['tokens']:,}",
                f"{row['upsampled_tokens']:,}",
                f"{row['mixture_tokens_per_pass']:,}",
            ]
            for row in rows
        ],
    )
    lengths = _table(
        ["document tokens", "documents", "appearances", "data tokens", "mixture tokens"],
        [
            [
                counts["lengths"],
                f"{counts['documents']:,}",
                f"{counts['appearances']:,}",
                f"{counts['data_share']:.1%}",
                f"{counts['mixture_share']:.1%}",
            ]
            for counts in bins
        ],
    )
    return [*sources, "", *lengths]


def plot_lengths(bins: list[dict], path: Path, title: str) -> None:
    """Share of tokens per length bin: the data as it is beside the mixture as trained."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(max(6, 0.6 * len(bins) + 2), 4.5))
    at = range(len(bins))
    for offset, key, label in (
        (-0.2, "data_share", "data as it is"),
        (0.2, "mixture_share", "mixture as trained"),
    ):
        axes.bar([x + offset for x in at], [100 * b[key] for b in bins], width=0.4, label=label)
    axes.set_xticks(list(at), [b["lengths"] for b in bins], rotation=45, ha="right")
    axes.set_xlabel("document length (tokens, BOS and EOS included)")
    axes.set_ylabel("share of tokens (%)")
    axes.set_title(title)
    axes.grid(axis="y", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def report(config_file: str, overrides: list[str], png: str | None, *, overwrite: bool) -> None:
    """Measure the job's data, print the tables and the JSON line, write the histogram."""
    config = parse_args(["--config", config_file, *overrides])
    check_training_data(config)
    if config.training.dataset != "local":
        raise ConfigError(
            f"{config.source_of('training.dataset')}: data_report reads local files, and "
            f"[training] dataset = {config.training.dataset!r} is streamed from the Hugging Face "
            "Hub; save it as .jsonl/.parquet files and set dataset = 'local' and dataset_path"
        )
    picture = Path(png) if png else Path(config.job.dump_folder) / "data_report.png"
    if not overwrite:
        refuse_existing([picture], "pass --overwrite to replace it, or name another --png")
    measured = measure_sources(config, job_tokenizer(config))
    rows = source_rows(measured)
    bins = length_bins(measured, rows)
    title = f"{config.config_file}: {len(rows)} source{'s' * (len(rows) != 1)}"
    with writing_file(picture, overwrite=overwrite) as temporary:
        plot_lengths(bins, temporary, title)
    # The command's output, on stdout whatever the log settings: the report, then its JSON line.
    print(
        f"{title} (tokens include BOS and EOS; pass every: mixture tokens per pass over a source)"
    )
    print("\n".join(format_report(rows, bins)), flush=True)
    logger.info("wrote %s", picture)
    print(json.dumps({"sources": rows, "lengths": bins, "png": str(picture)}), flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=OVERRIDES_HELP,
    )
    parser.add_argument("--config", required=True, help="job .toml (the one to train with)")
    parser.add_argument("--png", help="histogram PNG (default: [job] dump_folder/data_report.png)")
    parser.add_argument("--overwrite", action="store_true", help="replace the PNG if it exists")
    args, overrides = parser.parse_known_args(argv)
    return run_main(lambda: report(args.config, overrides, args.png, overwrite=args.overwrite))
