"""Train a Llama3 model with FSDP2 + UPipe context parallelism from a TOML job file.

    torchrun --nproc_per_node 2 train.py --config train_configs/debug_model.toml
    torchrun --nproc_per_node 8 train.py --config recipes/llama3_8b_5M.toml --training.steps 20

Any ``--section.key value`` after the config overrides that key of the file.

Exit codes: 0 trained to [training] steps (or already there); 1 a run-time failure explained in
one line (damaged snapshots, no space, non-finite loss, dump folder in use); 2 a configuration
error; 128 + N stopped by signal N (SIGTERM, SIGUSR1, Ctrl-C: 130), after saving a snapshot at
the step's end, or at once, keeping the last snapshot, on a second Ctrl-C or when the step would
outlast [job] stop_grace_seconds. torchrun itself exits 1 whenever a rank fails or a signal stops
it: the shell sees these codes from a job run without torchrun (docs/troubleshooting.md).
"""

from __future__ import annotations

import os
import sys

from upipe_dtensor.config import ConfigError, config_help, parse_args
from upipe_dtensor.runtime.errors import end_process, run_main


def _launcher_error(argv: list[str], config) -> ConfigError | None:
    """A job of several processes is started by torchrun, which sets RANK/WORLD_SIZE (a
    one-process job may run under plain ``python``)."""
    processes = config.parallelism.world_size
    if processes == 1 or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return None
    return ConfigError(
        "train.py is started by torchrun, which sets RANK and WORLD_SIZE for each process; run "
        f"torchrun --nproc_per_node {processes} train.py {' '.join(argv)}"
    )


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(  # the command's output: its help, as argparse prints it for the other commands
            __doc__
            + "\nOptions (--section.key value, the [section] key of the TOML file):\n"
            + config_help()
        )
        return 0
    from upipe_dtensor.train.trainer import Trainer  # after --help: importing torch takes seconds

    def train() -> None:
        config = parse_args(argv)
        if config.config_file is None:  # all defaults is never what a training job meant
            raise ConfigError(
                "command line: --config FILE.toml is required (e.g. --config "
                "train_configs/debug_model.toml); --help lists every --section.key option"
            )
        if error := _launcher_error(argv, config):
            raise error
        Trainer(config, exact_tokenizer=True).train()

    return run_main(train)


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
