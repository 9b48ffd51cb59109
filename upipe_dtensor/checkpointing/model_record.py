"""The model settings a snapshot was trained with: recorded in its manifest, compared with the
job's own when a job resumes from it, converts it or evaluates it.

Loading compares tensor shapes (``weights.check_shapes``), which catches a model of another size
but not the settings that change the numbers and no shape: RoPE's base and scaling (what a
context extension changes on purpose), the norm's epsilon, or a head layout whose weights have
the same shapes (2 heads of 128 instead of 8 of 32). Forgetting the ``--model.rope_*`` overrides
a job trained with would make an export or an evaluation silently wrong; here it is one line
naming each differing setting. ``[checkpoint] accept_model_change`` lets through, with a warning,
only the settings a job changes on purpose: RoPE's (a larger ``rope_theta`` or another scaling for
a longer context, ``CHANGEABLE``). The family, the shape, the vocabulary and the norm's epsilon
make another model, whose weights would load only in part (a Qwen3 snapshot into Llama3 drops
its QK-norm weights): those are refused whatever it says. Snapshots written before the record
existed are not checked.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from upipe_dtensor.checkpointing.manifest import read_manifest
from upipe_dtensor.config.schema import JobConfig
from upipe_dtensor.errors import ConfigError
from upipe_dtensor.models.hf_config import ModelArgs, shape_fields

logger = logging.getLogger(__name__)

INFORMATIVE = ("flavor",)
"""Recorded but not compared: a flavor and an ``hf`` config.json of the same shape are the same
model."""


_SET_BY = {
    "rope_theta": "model.rope_theta",
    "rope_scaling.factor": "model.rope_scaling_factor",
    "rope_scaling.low_freq_factor": "model.rope_low_freq_factor",
    "rope_scaling.high_freq_factor": "model.rope_high_freq_factor",
    "rope_scaling.original_max_position_embeddings": "model.rope_original_max_position_embeddings",
}
"""The [model] key that sets a recorded RoPE setting (the others come with the flavor or
hf_assets_path), so that a refusal blames where the value was written."""

CHANGEABLE = tuple(_SET_BY)
"""The settings ``accept_model_change`` lets change: RoPE's, which a context extension changes on
the same weights. Every other recorded setting makes another model."""


def _set_by(key: str) -> str:
    """The [model] key that sets a recorded setting: RoPE's own keys, ``name`` for the family,
    else the flavor (or its hf_assets_path)."""
    return _SET_BY.get(key) or ("model.name" if key == "name" else "model.flavor")


def model_record(config: JobConfig, args: ModelArgs) -> dict[str, Any]:
    """What a snapshot records of the model: the family, the flavor, and every setting that
    changes the numbers (config.json names: shape, vocabulary, norm epsilon, RoPE)."""
    return {"name": config.model.name, "flavor": config.model.flavor, **shape_fields(args)}


def model_changes(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Each compared setting that differs: key -> (the snapshot's value, this job's)."""
    return {
        key: (saved[key], now[key])
        for key in now
        if key not in INFORMATIVE and key in saved and saved[key] != now[key]
    }


def check_model_unchanged(
    snapshot: Path, config: JobConfig, args: ModelArgs, *, rank0: bool
) -> None:
    """ConfigError when ``snapshot`` was trained with other model settings than ``args``, unless
    only RoPE settings differ and [checkpoint] accept_model_change says so (then rank 0 warns).
    Not collective: reads the manifest."""
    saved = (read_manifest(snapshot) or {}).get("model")
    if saved is None:
        return
    changes = model_changes(saved, model_record(config, args))
    if not changes:
        return
    fixed = {key: change for key, change in changes.items() if key not in CHANGEABLE}
    if fixed or not config.checkpoint.accept_model_change:
        where = config.source_of(*{_set_by(key) for key in changes})
        if fixed:
            fix = (
                f"Changing {', '.join(fixed)} makes another model, which [checkpoint] "
                "accept_model_change does not allow (it lets only RoPE settings change: "
                f"{', '.join(CHANGEABLE)}). Pass the job config (and --model.* overrides) it was "
                "trained with"
            )
        else:
            fix = (
                "Pass the job config (and --model.* overrides) it was trained with, or set "
                "[checkpoint] accept_model_change = true to change them on purpose (e.g. a larger "
                "rope_theta to extend the context)"
            )
        raise ConfigError(
            f"{where}: snapshot {snapshot} was trained with other model settings: "
            f"{_listed(changes)}. {fix}"
        )
    if rank0:  # every rank compares alike: said once
        logger.warning(
            "snapshot %s was trained with other model settings: %s; using this job's "
            "([checkpoint] accept_model_change = true)",
            snapshot,
            _listed(changes),
        )


def _listed(changes: dict[str, tuple[Any, Any]]) -> str:
    return "; ".join(
        f"{key} = {was!r} there, {now!r} in this job" for key, (was, now) in changes.items()
    )
