"""The settings that turn a training job into a timing run, as command-line overrides: a few
steps and no snapshots (nor tensorboard events). The recipes are real jobs (2^30 tokens, a
snapshot at the interval ``plan`` suggests); timing one takes these on top:

    torchrun --nproc_per_node 8 train.py --config recipes/llama3_8b_1M.toml \\
        --model.tokenizer_path /models/Llama-3.1-8B $(python benchmarks/timing_overrides.py)

The benchmarks that run jobs (``throughput.py``, ``memory_stack.py``) take them from here.
"""

from __future__ import annotations

TIMING_RUN = (
    "--training.steps",
    "10",
    "--checkpoint.enable",
    "false",
    "--metrics.enable_tensorboard",
    "false",
)
"""Ten steps (the first warms caches and compiles), no snapshot, no events; a later
``--training.steps`` on the same command line wins."""

if __name__ == "__main__":
    print(" ".join(TIMING_RUN))
