"""The job configuration: ``schema`` (the dataclasses), ``loader`` (TOML, ``extends``,
``--section.key`` overrides, ``--help``) and ``checks`` (combinations that cannot run).

Everything a caller needs is importable from here: ``from upipe_dtensor.config import JobConfig,
parse_args, check_job, ConfigError``.
"""

from upipe_dtensor.config.checks import check_job
from upipe_dtensor.config.loader import OVERRIDES_HELP, config_help, load_config, parse_args
from upipe_dtensor.config.schema import ConfigError, JobConfig
from upipe_dtensor.parallel.registry import style_names
from upipe_dtensor.parallel.style_options import FPDT_PAPER_CHUNK_TOKENS

CP_STYLES: tuple[str, ...] = style_names()
"""The built-in context-parallel styles' names (``parallel.registry.style_names()`` is the live
list, with styles registered later)."""

__all__ = [
    "CP_STYLES",
    "FPDT_PAPER_CHUNK_TOKENS",
    "OVERRIDES_HELP",
    "ConfigError",
    "JobConfig",
    "check_job",
    "config_help",
    "load_config",
    "parse_args",
]
