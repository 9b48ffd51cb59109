"""The package's log output: one format, rank-aware, set up once per command (``run_main``).

Every module logs through ``logging.getLogger(__name__)`` under the ``upipe_dtensor`` logger.
A command's process shows it on the terminal: INFO and below on stdout, WARNING and above on
stderr (the start-up line and the step lines on stdout, warnings on stderr), or everything on
stderr for a command whose stdout is its report (``gpu_check``). The format is the message
itself on rank 0, so the lines read as they always have (``step     1 | loss 8.0622 | ...``),
``WARNING: `` (``ERROR: ``, ``DEBUG: ``) before any level but INFO, and ``[rank N] `` before
every line of another rank.

Rank 0 logs at INFO, every other rank at WARNING: a progress line that every rank logs shows
once, and a rank's own warning still shows (a warning that every rank reaches alike is logged by
rank 0 alone). Two environment variables change that (read when the command starts, before
any config, so they also cover the config's errors):

- ``UPIPE_LOG_LEVEL``: the level of the ranks that log (DEBUG, INFO, WARNING, ERROR; default
  INFO). ``UPIPE_LOG_LEVEL=WARNING`` silences the progress lines and keeps the warnings.
- ``UPIPE_LOG_RANKS``: which ranks log at that level: ``0`` (the default), ``all``, or a
  comma-separated list such as ``0,8``; the others log at WARNING.

Routing is Python's own: a program that embeds the package adds its handlers to the
``upipe_dtensor`` logger (this module only configures a command's process), and torchrun's
``--log-dir``/``--redirects``/``--tee`` write each rank's output to its own file. A command's
deliberate output (a report, a JSON line) and the one line that explains its exit code
(``runtime.errors.say_outcome``) are printed, not logged: no log setting hides them.
"""

from __future__ import annotations

import logging
import os
import sys

from upipe_dtensor.errors import ConfigError

PACKAGE_LOGGER = "upipe_dtensor"
LEVEL_ENV = "UPIPE_LOG_LEVEL"
RANKS_ENV = "UPIPE_LOG_RANKS"
QUIET_LEVEL = logging.WARNING
"""The level of the ranks ``UPIPE_LOG_RANKS`` does not name."""


class RankFormatter(logging.Formatter):
    """The one format: ``[rank N] `` on ranks other than 0, the level's name on every level but
    INFO, then the message."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = f"[rank {rank}] " if rank else ""

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else f"{record.levelname}: "
        text = f"{self.rank}{level}{record.getMessage()}"
        if record.exc_info:
            text = f"{text}\n{self.formatException(record.exc_info)}"
        return text


class ConsoleHandler(logging.Handler):
    """INFO and below to stdout, WARNING and above to stderr (everything to stderr with
    ``all_to_stderr``), flushed per line. The streams are looked up at each line, so a caller that
    swaps ``sys.stdout`` (pytest's capture) gets it."""

    def __init__(self, *, all_to_stderr: bool = False) -> None:
        super().__init__()
        self.all_to_stderr = all_to_stderr

    def emit(self, record: logging.LogRecord) -> None:
        try:
            to_stderr = self.all_to_stderr or record.levelno >= logging.WARNING
            stream = sys.stderr if to_stderr else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # logging's contract: a handler never raises into the caller
            self.handleError(record)


def _level(name: str) -> int:
    level = logging.getLevelName(name.strip().upper())
    if not isinstance(level, int):
        raise ConfigError(
            f"environment: {LEVEL_ENV}={name!r} is not a log level: use DEBUG, INFO, WARNING or "
            "ERROR"
        )
    return level


def _logs_at_level(rank: int, ranks: str) -> bool:
    if ranks.strip().lower() == "all":
        return True
    try:
        return rank in {int(part) for part in ranks.split(",") if part.strip()}
    except ValueError:
        raise ConfigError(
            f"environment: {RANKS_ENV}={ranks!r}: use 'all' or comma-separated ranks such as '0,8'"
        ) from None


def set_up_logging(rank: int | None = None, *, report_on_stdout: bool = False) -> None:
    """Send the package's log records to this process's terminal in the one format, at this
    rank's level (module docstring). ``rank``: torchrun's RANK unless given;
    ``report_on_stdout``: stdout holds only the command's report (``gpu_check``'s table), so
    every log line goes to stderr. Calling it again replaces the handler it added, never adds a
    second. A bad setting is a ``ConfigError``."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    level = _level(os.environ.get(LEVEL_ENV, "INFO"))
    if not _logs_at_level(rank, os.environ.get(RANKS_ENV, "0")):
        level = max(level, QUIET_LEVEL)
    package = logging.getLogger(PACKAGE_LOGGER)
    for handler in [h for h in package.handlers if isinstance(h, ConsoleHandler)]:
        package.removeHandler(handler)
    handler = ConsoleHandler(all_to_stderr=report_on_stdout)
    handler.setFormatter(RankFormatter(rank))
    package.addHandler(handler)
    package.setLevel(level)
