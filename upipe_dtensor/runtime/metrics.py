"""A step's scalars: one log line, and the same scalars to every sink the job asks for.

``MetricsLogger.log`` takes any mapping of scalars (the loop's loss, grad norm, learning rate...),
adds what it measures itself (tokens per second per device, peak memory, MFU against the one
peak table, ``runtime.peak_flops``), logs the step line every ``[metrics] log_freq`` steps and
hands the whole mapping to its sinks. A sink is anything with ``write(step, scalars)`` and
``close()``: tensorboard events, a JSON-lines file, Weights & Biases (the trainer's
``open_sinks`` builds them from ``[metrics]``). Sinks run on rank 0 only; the step line is logged
on every rank, which ``runtime.logs`` shows on rank 0 by default.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import resource
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from upipe_dtensor.errors import ConfigError
from upipe_dtensor.runtime.peak_flops import peak_flops

logger = logging.getLogger(__name__)

WANDB_MISSING = (
    "[metrics] enable_wandb = true, but wandb is not installed here: pip install wandb, or set "
    "enable_wandb = false"
)
WANDB_PROJECT = "upipe-dtensor"
"""The Weights & Biases project when ``WANDB_PROJECT`` is not set."""


def peak_memory_bytes(device: torch.device) -> tuple[int, int | None]:
    """(peak allocated, peak reserved): CUDA's caching allocator, whose reserved memory is what
    the GPU really gives up; on CPU the process's peak resident set and no reserved figure."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None  # Linux: KiB


class MetricsSink(Protocol):
    """Where a step's scalars go besides the log line."""

    def write(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Tensorboard events in ``folder``. ``first_step``: the step this run starts at;
    tensorboard hides events of earlier runs from that step on, so the steps a resumed job
    replays appear once."""

    def __init__(self, folder: Path, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked

        folder.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(folder), purge_step=first_step)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class JsonlSink:
    """One JSON object per step, ``{"step": N, name: value, ...}``, appended to ``path`` and
    flushed: readable while the job runs (``pandas.read_json(path, lines=True)``). Lines of an
    earlier run from ``first_step`` on are dropped when the file is opened, as tensorboard's
    purge does, so a resumed job's replayed steps appear once."""

    def __init__(self, path: Path, first_step: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            kept = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) < first_step
            ]
            temporary = path.with_name(path.name + ".partial")
            temporary.write_text("".join(f"{line}\n" for line in kept))
            os.replace(temporary, path)
        self.file = path.open("a")

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **scalars}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def wandb_missing() -> bool:
    """Whether ``import wandb`` would fail (without importing it: it takes seconds)."""
    if "wandb" in sys.modules:
        return sys.modules["wandb"] is None
    return importlib.util.find_spec("wandb") is None


class WandbSink:
    """A Weights & Biases run: ``wandb.init`` reads its usual environment (``WANDB_API_KEY``,
    ``WANDB_ENTITY``, ``WANDB_NAME``, ``WANDB_RUN_ID`` with ``WANDB_RESUME`` to continue a run,
    ``WANDB_MODE=offline``...); the project is ``WANDB_PROJECT``, else ``upipe-dtensor``. Its
    files go under ``folder`` and the run records ``run_config`` (the job's settings)."""

    def __init__(self, folder: Path, run_config: Mapping[str, Any]) -> None:
        if wandb_missing():
            raise ConfigError(WANDB_MISSING)
        import wandb  # optional: never a dependency of the package

        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT),
            dir=str(folder),
            config=dict(run_config),
        )

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


_LINE_FORMATS = {
    "loss": "loss {:.4f}",
    "grad_norm": "grad_norm {:.3f}",
    "lr": "lr {:.2e}",
    "tokens_per_second_per_device": "tok/s/dev {:,.0f}",
}
"""The step line's leading fields, in order; MFU, memory and host offload follow, then any other
scalar as ``name value``."""
_MEASURED = {"mfu_percent", "memory_peak_gib", "memory_reserved_gib", "host_offload_gib"}


def step_line(step: int, scalars: Mapping[str, float], no_mfu: str = "n/a") -> str:
    """``step     1 | loss 8.0622 | grad_norm ... | mem 1.23 GiB``: the fields present, in a
    fixed order (``no_mfu`` stands in for an MFU the device cannot give)."""
    fields = [f"step {step:5d}"]
    fields += [
        form.format(scalars[name]) for name, form in _LINE_FORMATS.items() if name in scalars
    ]
    if "tokens_per_second_per_device" in scalars:
        mfu = scalars.get("mfu_percent")
        fields.append(f"mfu {mfu:.1f}%" if mfu is not None else f"mfu {no_mfu}")
    if "memory_peak_gib" in scalars:
        reserved = scalars.get("memory_reserved_gib")
        fields.append(
            f"mem {scalars['memory_peak_gib']:.2f} GiB"
            + (f" (reserved {reserved:.2f} GiB)" if reserved is not None else "")
        )
    if "host_offload_gib" in scalars:
        fields.append(f"host offload {scalars['host_offload_gib']:.2f} GiB")
    fields += [
        f"{name} {value:.4g}"
        for name, value in scalars.items()
        if name not in _LINE_FORMATS and name not in _MEASURED
    ]
    return " | ".join(fields)


class MetricsLogger:
    def __init__(
        self,
        *,
        sinks: Iterable[MetricsSink] = (),
        log_freq: int,
        device: torch.device,
        flops_per_token: float,
        world_size: int,
    ) -> None:
        """``sinks``: where the scalars go besides the log line (``train.trainer.open_sinks``;
        none on ranks other than 0)."""
        self.sinks = list(sinks)
        self.log_freq = log_freq
        self.device = device
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.peak, self.no_mfu = peak_flops(device)

    def log(
        self, step: int, scalars: Mapping[str, float], *, tokens: int, seconds: float
    ) -> dict[str, float]:
        """Log ``scalars`` with what this logger measures; returns them all. ``tokens``: all
        tokens of the step over all ranks; ``seconds``: the step's wall time."""
        tokens_per_device = tokens / seconds / self.world_size
        logged = {**scalars, "tokens_per_second_per_device": tokens_per_device}
        allocated, reserved = peak_memory_bytes(self.device)
        logged["memory_peak_gib"] = allocated / 2**30
        if reserved is not None:
            logged["memory_reserved_gib"] = reserved / 2**30
        if self.peak is not None:
            logged["mfu_percent"] = 100 * self.flops_per_token * tokens_per_device / self.peak
        for sink in self.sinks:
            sink.write(step, logged)
        if step % self.log_freq == 0 or step == 1:
            logger.info(step_line(step, logged, self.no_mfu))
        return logged

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
