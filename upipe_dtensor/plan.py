"""``python -m upipe_dtensor.plan``: the memory planner: will this recipe fit, what is the longest
context.

The command lives in ``upipe_dtensor.planning.cli``;
this module is its name on the command line, and
``main`` is the ``upipe-plan`` console script's (``[project.scripts]``).
"""

import sys

from upipe_dtensor.planning.cli import main as _command
from upipe_dtensor.runtime.errors import end_process


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (the process's arguments when None); returns its exit code."""
    return _command(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    end_process(main())
