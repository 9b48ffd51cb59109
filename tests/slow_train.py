"""train.py whose steps each take ``SLOW_STEP_SECONDS`` longer, for tests of stopping during a
long step (a step of a 1M-token recipe takes minutes): every step sleeps that long before it
runs. Everything else is train.py as a user runs it, under torchrun."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

from upipe_dtensor.runtime.errors import end_process
from upipe_dtensor.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


def _slow(train_step, seconds: float):
    def slow_step(self, microbatches):
        time.sleep(seconds)
        return train_step(self, microbatches)

    return slow_step


if __name__ == "__main__":
    Trainer.train_step = _slow(Trainer.train_step, float(os.environ["SLOW_STEP_SECONDS"]))
    spec = importlib.util.spec_from_file_location("train_entry", REPO / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    end_process(train.main(sys.argv[1:]))
