"""Training data that is readable but will train badly, said in one start-up line each.

Nothing here stops a job: each case can be meant. They are found from the start-up scan
(``data.checks``) without tokenizing the corpus: a token folder's manifest counts its tokens
exactly, and a text source's tokens are estimated from its characters and the tokens per
character of its first ``checks.SAMPLE_CHARACTERS`` (exact when that sample is the whole source,
as it is for the small corpora the first case is about).

- **Less data than one sequence.** The packer repeats the data to fill every window, so every
  sequence holds the same documents again: the loss falls fast and means little.
- **A source read many times over.** Past about four passes, repeated tokens are worth less and
  less than new ones (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models": up to
  4 epochs cost almost nothing against unique data, then returns fade), so a source this job
  reads more than ``MANY_PASSES`` times is named, with its passes. A mixture's small source with a
  large weight is the usual case.
- **A .txt file that is one document of many lines.** Documents in a .txt file are separated by
  form feeds; a file of one document per line without them is a single document.
"""

from __future__ import annotations

from upipe_dtensor.config.schema import JobConfig
from upipe_dtensor.data.checks import MANY_LINES, DataScan, SourceScan
from upipe_dtensor.data.loader import job_tokenizer
from upipe_dtensor.data.mixture import Encoder

MANY_PASSES = 4.0
"""Passes over a source beyond which the start-up log names it (Muennighoff et al. 2023)."""
SHOWN = 3
"""Files named in the .txt warning; the rest are counted."""
FORM_FEED_FIX = (
    "separate the documents of a .txt file with form feeds ('\\f'), or write one JSON object per "
    "line to a .jsonl file (docs/training.md, Data); if each file is one document, this is what "
    "you want"
)


def source_tokens(source: SourceScan, tokenizer: Encoder | None) -> tuple[int, bool]:
    """The source's tokens as packed (BOS and EOS included), and whether that is exact: a token
    folder's count, or the characters scaled by the sample's tokens per character."""
    if source.tokens is not None:
        return source.tokens, True
    sampled = sum(map(len, source.sample))
    if not sampled:
        return 2 * source.documents, True
    tokens = sum(len(tokenizer.encode(text)) for text in source.sample)
    exact = sampled == source.characters
    estimate = tokens if exact else round(source.characters * tokens / sampled)
    return estimate + 2 * source.documents, exact


def data_warnings(config: JobConfig, scan: DataScan, dp: int) -> list[str]:
    """One line per problem the job's local data has (none: an empty list); ``dp`` data-parallel
    ranks share the documents. Loads the job's tokenizer if a text source needs a count."""
    training = config.training
    tokenizer = job_tokenizer(config) if any(s.tokens is None for s in scan.sources) else None
    window = training.seq_len + 1
    read_per_rank = (
        training.steps * training.local_batch_size * training.gradient_accumulation_steps * window
    )
    sources = training.data_sources
    total_weight = sum(source.weight for source in sources)
    sizes = [source_tokens(found, tokenizer) for found in scan.sources]
    lines = []
    per_rank = sum(tokens for tokens, _ in sizes) / dp
    about = "" if all(exact for _, exact in sizes) else "about "
    if per_rank < window:
        lines.append(
            f"[training] data: {scan.description} holds {about}{per_rank:,.0f} tokens per "
            f"data-parallel rank ({dp} rank{'s' * (dp != 1)}), fewer than one sequence of "
            f"seq_len + 1 = {window:,}: every sequence repeats the same documents, and the loss "
            "falls fast without meaning much; add data or lower [training] seq_len"
        )
    else:
        repeated = []
        for found, source, (tokens, exact) in zip(scan.sources, sources, sizes):
            passes = source.weight / total_weight * read_per_rank / (tokens / dp)
            if passes > MANY_PASSES:
                repeated.append(f"{found.description} {'' if exact else 'about '}{passes:,.0f}")
        if repeated:
            lines.append(
                f"[training] data: this job's {training.steps:,} steps read "
                + ", ".join(repeated)
                + f" times over; past about {MANY_PASSES:g} passes repeated tokens are worth "
                "less and less than new ones (Muennighoff et al. 2023): add data, lower the "
                "source's weight, or train fewer steps"
            )
    one_document = [
        (f"{found.description}: {name}", count)
        for found in scan.sources
        for name, count in found.one_document_txt
    ]
    if one_document:
        named = ", ".join(f"{name} ({count:,} lines)" for name, count in one_document[:SHOWN])
        more = f" and {len(one_document) - SHOWN} more" if len(one_document) > SHOWN else ""
        lines.append(
            f"[training] data: {len(one_document)} .txt file{'s' * (len(one_document) != 1)} "
            f"of {MANY_LINES:,} lines or more {'are' if len(one_document) > 1 else 'is'} read "
            f"as one document each: {named}{more}; {FORM_FEED_FIX}"
        )
    return lines
