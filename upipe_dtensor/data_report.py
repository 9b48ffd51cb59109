"""``python -m upipe_dtensor.data_report``: the training data mixture as the job will train on it
(tokens per source before and after upsampling, document lengths), before training.

The command lives in ``upipe_dtensor.data.report``;
this module is its name on the command line, and
``main`` is the ``upipe-data-report`` console script's (``[project.scripts]``).
"""

import sys

from upipe_dtensor.data.report import main as _command
from upipe_dtensor.runtime.errors import end_process


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (the process's arguments when None); returns its exit code."""
    return _command(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    end_process(main())
