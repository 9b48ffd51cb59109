"""What one step holds, recorded in each snapshot's manifest and compared when a job resumes.

A resume may change what a step holds on purpose: a longer ``seq_len`` extends a snapshot's
context, another batch size or gradient accumulation trades steps for tokens, other weights
shift a mixture's shares. Each is honoured, but the losses change with it, so a resume that makes
one says so in one line, with what it means:

- the data: the loader's saved position is a token (a document and the tokens of it already
  used, ``data.loader.PackedTextLoader``), so the data goes on from the token the snapshot stopped
  at, in the new windows, nothing skipped or repeated; a mixture goes on from each source's
  position and moves to the new shares from there (``data.mixture.Mixture``);
- the schedule: the learning rate is a function of the step (``train.optimizer.lr_lambda``), so the
  steps still to train follow it as before, holding another number of tokens.

What cannot be honoured is refused, naming the key: a mixture's position is one per source, in
the order of its ``[[training.sources]]`` tables, so another number of sources, or the same paths
in another order, would hand each source another's position. Snapshots written before the
record are not checked.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from upipe_dtensor.checkpointing.manifest import read_manifest
from upipe_dtensor.config.schema import JobConfig
from upipe_dtensor.errors import ConfigError

logger = logging.getLogger(__name__)

SIZES = ("seq_len", "local_batch_size", "gradient_accumulation_steps")
"""The [training] keys whose product (times the data-parallel degree) is a step's tokens."""
UPSAMPLING = ("upsample_min_tokens", "upsample_factor")


def batch_record(config: JobConfig) -> dict[str, Any]:
    """What a snapshot records of a step: its sizes and its sources (the one ``dataset_path`` as
    a source of weight 1 when there are no tables, as the loader reads it)."""
    training = config.training
    return {
        **{key: getattr(training, key) for key in SIZES},
        "sources": [
            {"path": s.path, "weight": s.weight, **{k: getattr(s, k) for k in UPSAMPLING}}
            for s in training.data_sources
        ],
    }


def _tokens(record: dict[str, Any], dp: int) -> int:
    return (
        dp * record["seq_len"] * record["local_batch_size"] * record["gradient_accumulation_steps"]
    )


def _shares(sources: list[dict[str, Any]]) -> str:
    total = sum(source["weight"] for source in sources)
    return ", ".join(f"{source['weight'] / total:.0%}" for source in sources)


def _refusal(saved: list[dict], now: list[dict]) -> str:
    """Why the saved sources' positions cannot be handed to this job's ("" if they can)."""
    before, after = [s["path"] for s in saved], [s["path"] for s in now]
    if len(before) != len(after):
        return (
            f"the snapshot read {len(before)} source{'s' * (len(before) != 1)} and this job "
            f"reads {len(after)}: its saved position is one per source, which cannot be handed "
            "to another number of them"
        )
    if before != after and sorted(before) == sorted(after):
        return (
            f"the same sources in another order ({', '.join(before)} there, {', '.join(after)} "
            "here): its saved position is one per source, in order, so each would go on from "
            "another's"
        )
    return ""


def step_changes(saved: dict[str, Any], now: dict[str, Any], dp: int, steps_left: int) -> str:
    """The honoured changes of what a step holds, in words ("" if none)."""
    said = []
    sizes = [f"{key} {saved[key]} -> {now[key]}" for key in SIZES if saved[key] != now[key]]
    if sizes:
        was, tokens = _tokens(saved, dp), _tokens(now, dp)
        said.append(
            f"[training] {', '.join(sizes)} (tokens per step {was:,} -> {tokens:,}): the data "
            "goes on from the token the snapshot stopped at, in the new sequences (nothing "
            "skipped or repeated), and the learning-rate schedule counts steps, so the "
            f"{steps_left:,} steps left train {steps_left * tokens:,} tokens, not "
            f"{steps_left * was:,}"
        )
    before, after = saved["sources"], now["sources"]
    weights = [", ".join(f"{s['weight']:g}" for s in sources) for sources in (before, after)]
    if weights[0] != weights[1]:
        said.append(
            f"[[training.sources]] weights {weights[0]} -> {weights[1]} (shares "
            f"{_shares(before)} -> {_shares(after)}): each source goes on from its saved "
            "position, and the mixture moves to the new shares from here"
        )
    upsampled = [
        f"#{number} {key} {was[key]} -> {source[key]}"
        for number, (was, source) in enumerate(zip(before, after), 1)
        for key in UPSAMPLING
        if was[key] != source[key]
    ]
    if upsampled:
        said.append(
            f"[[training.sources]] {', '.join(upsampled)}: the documents from here on are "
            "repeated by the new rule (the copies already placed still come)"
        )
    return "; ".join(said)


def check_batch_change(
    snapshot: Path, config: JobConfig, dp: int, resumed_at: int, *, rank0: bool
) -> None:
    """One warning line (rank 0) when this job's step holds other than ``snapshot``'s (step
    ``resumed_at``) did, with what it means for the data and the schedule; ConfigError naming
    [[training.sources]] when the saved data position cannot be handed to this job's sources.
    Not collective: reads the manifest."""
    saved = (read_manifest(snapshot) or {}).get("batch")
    if saved is None:
        return
    now = batch_record(config)
    refusal = _refusal(saved["sources"], now["sources"])
    if refusal:
        raise ConfigError(
            f"{config.source_of('training.sources', 'training.dataset_path')}: cannot resume "
            f"snapshot {snapshot} on these [[training.sources]]: {refusal}. Resume with the "
            "sources it was saved with, in their order (weights and upsampling may change), or "
            "set another [job] dump_folder to start over"
        )
    changes = step_changes(saved, now, dp, config.training.steps - resumed_at)
    if changes and rank0:  # every rank compares alike: said once
        logger.warning("resuming snapshot %s with another step: %s", snapshot, changes)
