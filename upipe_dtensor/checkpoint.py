"""Atomic torch.distributed.checkpoint snapshots: model, optimizer, LR schedule, data loader, step.

A snapshot is written to ``step-N.partial`` and renamed to ``step-N`` only after every rank has
finished writing, so a job killed mid-save never leaves a half-written snapshot that looks
complete: resume picks the newest ``step-N`` and ignores ``.partial`` folders. Model and optimizer
state are DTensors, so a snapshot taken with one cp degree loads into a job with another.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

_SNAPSHOT = re.compile(r"^step-(\d+)$")


class _ModelAndOptimizer(Stateful):
    def __init__(self, model: nn.Module, optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )


class _Pickled(Stateful):
    """Small Python state as one opaque value under ``key`` (per data-parallel rank if needed)."""

    def __init__(self, key: str, get, put) -> None:
        self.key, self.get, self.put = key, get, put

    def state_dict(self) -> dict:
        return {self.key: pickle.dumps(self.get())}

    def load_state_dict(self, state: dict) -> None:
        self.put(pickle.loads(state[self.key]))


class Checkpointer:
    def __init__(
        self,
        folder: str,
        *,
        interval: int,
        keep_latest_k: int,
        model: nn.Module,
        optimizer,
        lr_scheduler,
        dataloader,
        dp_rank: int,
    ) -> None:
        self.folder = Path(folder)
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.step = 0
        self.states = {
            "train": _ModelAndOptimizer(model, optimizer),
            "lr_scheduler": _Pickled("state", lr_scheduler.state_dict, lr_scheduler.load_state_dict),
            "dataloader": _Pickled(f"dp_rank_{dp_rank}", dataloader.state_dict, dataloader.load_state_dict),
            "progress": _Pickled("state", lambda: self.step, self._set_step),
        }

    def _set_step(self, step: int) -> None:
        self.step = step

    def snapshots(self) -> dict[int, Path]:
        """Complete snapshots by step (half-written ``.partial`` folders are not listed)."""
        if not self.folder.is_dir():
            return {}
        found = (_SNAPSHOT.match(p.name) for p in self.folder.iterdir() if p.is_dir())
        return {int(m.group(1)): self.folder / m.group(0) for m in found if m}

    def load(self, step: int = -1) -> int:
        """Restore the newest (or the given) snapshot; returns its step, 0 if there is none."""
        snapshots = self.snapshots()
        if step != -1 and step not in snapshots:
            raise ValueError(
                f"checkpoint.load_step={step} not found in {self.folder}; available: {sorted(snapshots)}"
            )
        if not snapshots:
            return 0
        path = snapshots[step if step != -1 else max(snapshots)]
        dcp.load(self.states, checkpoint_id=str(path))
        return self.step

    def maybe_save(self, step: int, *, last: bool) -> None:
        if step % self.interval == 0 or last:
            self.save(step)

    def save(self, step: int) -> None:
        final = self.folder / f"step-{step}"
        if final.exists():  # resumed exactly at a saved step: it is already on disk
            return
        partial = self.folder / f"step-{step}.partial"
        self.step = step
        if dist.get_rank() == 0 and partial.exists():
            shutil.rmtree(partial)  # debris of a save that was killed
        dist.barrier()
        dcp.save(self.states, checkpoint_id=str(partial))
        dist.barrier()  # every rank's shards are on disk
        if dist.get_rank() == 0:
            os.replace(partial, final)
            self._prune()
        dist.barrier()

    def _prune(self) -> None:
        if self.keep_latest_k <= 0:
            return
        snapshots = self.snapshots()
        for old in sorted(snapshots)[: -self.keep_latest_k]:
            shutil.rmtree(snapshots[old])
