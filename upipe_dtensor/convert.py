"""``python -m upipe_dtensor.convert``: convert weights between our DCP snapshots and Hugging Face
folders.

The command lives in ``upipe_dtensor.commands.convert``; this module is its name on the command
line, and ``main`` is the ``upipe-convert`` console script's (``[project.scripts]``).
"""

from upipe_dtensor.commands.convert import main as _command
from upipe_dtensor.runtime.errors import command_main


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (``runtime.errors.command_main``)."""
    return command_main(_command, argv)


if __name__ == "__main__":
    main()
