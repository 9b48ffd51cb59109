"""Run a command's script with rank 0 starting ``LATE_RANK0_SECONDS`` after the other ranks, as on
a loaded machine where rank 0 is still importing torch when the others have failed: for tests that
a failure reaches the terminal whichever rank reports it first. Usage, under torchrun:
``late_rank0.py SCRIPT ARGS...``."""

from __future__ import annotations

import os
import runpy
import sys
import time

if __name__ == "__main__":
    if os.environ.get("RANK") == "0":
        time.sleep(float(os.environ["LATE_RANK0_SECONDS"]))
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
