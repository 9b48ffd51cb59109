"""``python -m upipe_dtensor.plan``: the memory planner: will this recipe fit, what is the longest
context.

The command lives in ``upipe_dtensor.planning.cli``; this module is its name on the command line,
and ``main`` is the ``upipe-plan`` console script's (``[project.scripts]``).
"""

import sys

from upipe_dtensor.planning.cli import main as _command
from upipe_dtensor.runtime.errors import end_process


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv``; returns its exit code. Without ``argv`` it is the process's
    command (``python -m``, the console script): it reads ``sys.argv`` and ends the process with
    the code through ``end_process``, as every entry point that may run ranks does."""
    if argv is not None:
        return _command(argv)
    end_process(_command(sys.argv[1:]))


if __name__ == "__main__":
    main()
