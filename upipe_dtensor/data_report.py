"""``python -m upipe_dtensor.data_report``: the training data mixture as the job will train on it
(tokens per source before and after upsampling, document lengths), before training.

The command lives in ``upipe_dtensor.data.report``; this module is its name on the command line, and
``main`` is the ``upipe-data-report`` console script's (``[project.scripts]``).
"""

from upipe_dtensor.data.report import main as _command
from upipe_dtensor.runtime.errors import command_main


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (``runtime.errors.command_main``)."""
    return command_main(_command, argv)


if __name__ == "__main__":
    main()
