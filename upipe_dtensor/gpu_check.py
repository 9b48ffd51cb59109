"""``torchrun --nproc_per_node N -m upipe_dtensor.gpu_check``: a user's first GPU run, every
style against the unsharded model in bf16 and one step of the 8B shape beside the planner's
prediction, printed as one table to paste into an issue.

The command lives in ``upipe_dtensor.verify.gpu_check``; this module is its name on the command
line, and ``main`` is the ``upipe-gpu-check`` console script's (``[project.scripts]``).
"""

from upipe_dtensor.runtime.errors import command_main
from upipe_dtensor.verify.gpu_check import main as _command


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (``runtime.errors.command_main``)."""
    return command_main(_command, argv)


if __name__ == "__main__":
    main()
