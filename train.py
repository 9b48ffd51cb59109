"""Train a Llama3 model with FSDP2 + UPipe context parallelism from a TOML job file.

    torchrun --nproc_per_node 2 train.py --config train_configs/debug_model.toml
    torchrun --nproc_per_node 8 train.py --config recipes/llama3_8b_5M.toml --training.steps 20

Any ``--section.key value`` after the config overrides that key of the file.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from upipe_dtensor.config import ConfigError, parse_args
from upipe_dtensor.trainer import Trainer


def main(argv: list[str]) -> int:
    try:
        config = parse_args(argv)
        trainer = Trainer(config)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    try:
        trainer.train()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
