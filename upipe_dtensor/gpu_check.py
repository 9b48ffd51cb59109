"""``torchrun --nproc_per_node N -m upipe_dtensor.gpu_check``: a user's first GPU run, every
style against the unsharded model in bf16 and one step of the 8B shape beside the planner's
prediction, printed as one table to paste into an issue.

The command lives in ``upipe_dtensor.verify.gpu_check``; this module is its name on the command
line, and ``main`` is the ``upipe-gpu-check`` console script's (``[project.scripts]``).
"""

import sys

from upipe_dtensor.runtime.errors import end_process
from upipe_dtensor.verify.gpu_check import main as _command


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv``; returns its exit code. Without ``argv`` it is the process's
    command (``python -m``, the console script): it reads ``sys.argv`` and ends the process with
    the code through ``end_process``, as every entry point that may run ranks does."""
    if argv is not None:
        return _command(argv)
    end_process(_command(sys.argv[1:]))


if __name__ == "__main__":
    main()
