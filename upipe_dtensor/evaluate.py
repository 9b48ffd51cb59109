"""``python -m upipe_dtensor.evaluate``: evaluate a job's weights on held-out token sequences (loss
by position).

The command lives in ``upipe_dtensor.commands.evaluate``; this module is its name on the command
line, and ``main`` is the ``upipe-evaluate`` console script's (``[project.scripts]``).
"""

import sys

from upipe_dtensor.commands.evaluate import main as _command
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
