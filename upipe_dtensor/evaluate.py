"""``python -m upipe_dtensor.evaluate``: evaluate a job's weights on held-out token sequences (loss
by position).

The command lives in ``upipe_dtensor.commands.evaluate``;
this module is its name on the command line, and
``main`` is the ``upipe-evaluate`` console script's (``[project.scripts]``).
"""

import sys

from upipe_dtensor.commands.evaluate import main as _command
from upipe_dtensor.runtime.errors import end_process


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (the process's arguments when None); returns its exit code."""
    return _command(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    end_process(main())
