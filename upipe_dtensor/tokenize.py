"""``python -m upipe_dtensor.tokenize``: tokenize a job's training text once into a token folder,
which training memory-maps instead of tokenizing (``[training] dataset_path`` = the folder).

The command lives in ``upipe_dtensor.data.tokenize``;
this module is its name on the command line, and
``main`` is the ``upipe-tokenize`` console script's (``[project.scripts]``).
"""

import sys

from upipe_dtensor.data.tokenize import main as _command
from upipe_dtensor.runtime.errors import end_process


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (the process's arguments when None); returns its exit code."""
    return _command(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    end_process(main())
