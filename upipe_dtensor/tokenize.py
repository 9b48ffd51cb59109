"""``python -m upipe_dtensor.tokenize``: tokenize a job's training text once into a token folder,
which training memory-maps instead of tokenizing (``[training] dataset_path`` = the folder).

The command lives in ``upipe_dtensor.data.tokenize``; this module is its name on the command line,
and ``main`` is the ``upipe-tokenize`` console script's (``[project.scripts]``).
"""

from upipe_dtensor.data.tokenize import main as _command
from upipe_dtensor.runtime.errors import command_main


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (``runtime.errors.command_main``)."""
    return command_main(_command, argv)


if __name__ == "__main__":
    main()
