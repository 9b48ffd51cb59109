"""``python -m upipe_dtensor.plan``: the memory planner: will this recipe fit, what is the longest
context.

The command lives in ``upipe_dtensor.planning.cli``; this module is its name on the command line,
and ``main`` is the ``upipe-plan`` console script's (``[project.scripts]``).
"""

from upipe_dtensor.planning.cli import main as _command
from upipe_dtensor.runtime.errors import command_main


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (``runtime.errors.command_main``)."""
    return command_main(_command, argv)


if __name__ == "__main__":
    main()
