"""Long-context evaluation: next-token loss by position, under the job's context parallelism.

    torchrun --nproc_per_node 8 -m upipe_dtensor.evaluate \\
        --config recipes/llama3_8b_extend_1M.toml \\
        --tokens eval_1M.npy --model.hf_assets_path /models/Llama-3.1-8B
    python -m upipe_dtensor.evaluate --config job.toml --tokens tokens.npy   # cp = 1, no launcher

TOKENS.npy is an integer array (N, S) of token ids; S becomes [training] seq_len (it must be
divisible by the CP degree). The model is built, parallelised and loaded exactly as train.py does
(``build.build_parallel_model``), from the job's snapshot, else [checkpoint] initial_load_path.
The snapshot is chosen as the trainer chooses the one to resume from (``checkpoint``): the newest
(or [checkpoint] load_step's) that matches its manifest; a damaged newest one is set aside with a
warning and an older good one is used; with none good, evaluate stops with the trainer's error
(exit 1). Configuration errors exit 2, before any process group. [training] attention_mask /
position_ids are honoured. Rows are split over the
data-parallel ranks and each sequence over the CP ranks; per-token losses are put back in sequence
order with the CP style's ``shard_positions``.

The last stdout line is one JSON object:
``{"loss": mean cross-entropy of every predicted token (position t predicts token t+1, t = 0..S-2,
all rows), "predicted_tokens": N * (S - 1), "loss_by_position": {"lo-hi": mean loss of positions
lo..hi}}`` with buckets 0, 1, 2-3, 4-7, ... (powers of two). The same object (with the weights
and mask) and a PNG of loss against position are written to [job] dump_folder as
``loss_by_position_{tokens}_{weights}_{mask}.json`` / ``.png``, where weights is the snapshot
(``step-N``) or the initial weights (``hf``, ``dcp``): the curve to look at after context
extension (does the loss keep falling with more context?), with the "before" and "after" runs
side by side. An existing output is refused before any heavy work unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from upipe_dtensor.checkpointing.outputs import refuse_existing
from upipe_dtensor.checkpointing.snapshots import snapshot_candidates
from upipe_dtensor.commands import retrieval
from upipe_dtensor.commands.eval_common import load_job_model, weights_tag, write_outputs
from upipe_dtensor.config import OVERRIDES_HELP, ConfigError, JobConfig, parse_args
from upipe_dtensor.models import IGNORE_INDEX
from upipe_dtensor.models.hf_config import model_args
from upipe_dtensor.runtime.collectives import on_rank0
from upipe_dtensor.runtime.errors import run_main
from upipe_dtensor.train.build import ParallelModel

logger = logging.getLogger(__name__)

OUTPUT_FIX = (
    "an earlier run on the same tokens, weights and mask wrote it: pass --overwrite to replace "
    "it, or move it away"
)


def read_tokens(path: str) -> torch.Tensor:
    """The (N, S) int64 token ids of a .npy file; ConfigError naming the problem."""
    if not Path(path).is_file():
        raise ConfigError(
            f"--tokens {path}: no such file; pass a .npy array of token ids, shape (N, S)"
        )
    try:
        array = np.load(path, allow_pickle=False)
    except ValueError as err:
        raise ConfigError(f"--tokens {path}: not a .npy array ({err})") from err
    if array.ndim != 2 or array.shape[1] < 2 or array.shape[0] < 1:
        raise ConfigError(
            f"--tokens {path}: shape {array.shape}; expected (N, S) with N >= 1 rows of S >= 2 "
            "tokens"
        )
    if not np.issubdtype(array.dtype, np.integer):
        raise ConfigError(f"--tokens {path}: dtype {array.dtype}; token ids must be integers")
    return torch.from_numpy(array.astype(np.int64))


def position_buckets(seq_len: int) -> list[tuple[int, int]]:
    """Inclusive ranges of predicting positions 0..seq_len-2: [0, 0], [1, 1], [2, 3], [4, 7], ..."""
    last = seq_len - 2
    buckets, low = [(0, 0)], 1
    while low <= last:
        buckets.append((low, min(2 * low - 1, last)))
        low *= 2
    return buckets


@torch.no_grad()
def position_loss_sums(built: ParallelModel, tokens: torch.Tensor) -> torch.Tensor:
    """(S,) float64: for each predicting position t, the sum over all rows of the loss of token
    t+1 (the last entry is 0: nothing follows). The same on every rank."""
    rows, seq_len = tokens.shape
    mine = list(
        range(built.setup.dp_rank, rows, built.setup.dp)
    )  # data-parallel ranks split the rows
    batch = built.setup.config.training.local_batch_size
    # Every rank runs the same number of forwards: FSDP gathers parameters over all of them.
    forwards = math.ceil(math.ceil(rows / built.setup.dp) / batch)
    positions = built.cp_style.shard_positions(seq_len, built.setup.cp_rank, built.setup.cp)
    local = torch.zeros(positions.numel(), dtype=torch.float64, device=built.setup.device)
    built.model.eval()
    for index in range(forwards):
        chosen = mine[index * batch : (index + 1) * batch]
        inputs = tokens[chosen or [0]]  # a stand-in row keeps this rank in step; not counted
        labels = torch.full_like(inputs, IGNORE_INDEX)
        labels[:, :-1] = inputs[:, 1:]
        losses = built(
            built.shard_sequence(inputs),
            labels=built.shard_sequence(labels),
            per_token=True,
            **built.document_inputs(inputs),
        )
        if chosen:
            local += losses.double().sum(0)
    sums = torch.zeros(seq_len, dtype=torch.float64, device=built.setup.device)
    sums[positions.to(built.setup.device)] = local
    dist.all_reduce(sums)  # CP ranks hold distinct positions, dp ranks distinct rows
    return sums.cpu()


def summarise(sums: torch.Tensor, rows: int) -> dict:
    """The JSON result from per-position loss sums over ``rows`` rows."""
    seq_len = sums.shape[0]
    predicted = rows * (seq_len - 1)
    by_position = {}
    for low, high in position_buckets(seq_len):
        key = str(low) if low == high else f"{low}-{high}"
        by_position[key] = sums[low : high + 1].sum().item() / (rows * (high - low + 1))
    return {
        "loss": sums.sum().item() / predicted,
        "predicted_tokens": predicted,
        "loss_by_position": by_position,
    }


def plot_loss_by_position(
    sums: torch.Tensor, rows: int, result: dict, path: Path, title: str
) -> None:
    """Per-position mean loss (averaged into at most ~2000 points) and the bucket means,
    against position on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mean = (sums[:-1] / rows).numpy()
    window = max(1, len(mean) // 2000)
    smooth = mean[: len(mean) // window * window].reshape(-1, window).mean(1)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.plot(
        np.arange(len(smooth)) * window + (window - 1) / 2 + 1,
        smooth,
        lw=0.8,
        alpha=0.5,
        label=f"mean over rows{f', {window}-position windows' if window > 1 else ''}",
    )
    centers, values = [], []
    for key, value in result["loss_by_position"].items():
        low, _, high = key.partition("-")
        centers.append((int(low) + int(high or low)) / 2 + 1)
        values.append(value)
    axes.plot(centers, values, marker="o", label="power-of-two buckets")
    axes.set_xscale("log")
    axes.set_xlabel("position + 1 (tokens of context)")
    axes.set_ylabel("next-token cross-entropy")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def mask_tag(config: JobConfig) -> str:
    """The mask in an output's name: [training] attention_mask (and per-document positions)."""
    training = config.training
    positions = "-document-positions" if training.position_ids == "document" else ""
    return f"{training.attention_mask}{positions}"


def output_paths(config: JobConfig, tokens_file: str, snapshot: Path | None) -> tuple[Path, Path]:
    """This run's plot and JSON: named by the tokens, the weights and the mask, so runs on other
    weights or another mask never write the same file."""
    name = f"loss_by_position_{Path(tokens_file).stem}_{weights_tag(config, snapshot)}"
    folder = Path(config.job.dump_folder)
    return folder / f"{name}_{mask_tag(config)}.png", folder / f"{name}_{mask_tag(config)}.json"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=OVERRIDES_HELP,
    )
    parser.add_argument("--config", required=True, help="job .toml (the one trained with)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace this run's plot and JSON if they exist"
    )
    parser.add_argument("--tokens", help=".npy integer array (N, S) of token ids")
    parser.add_argument(
        "--task",
        choices=sorted(retrieval.TASKS),
        help="retrieval at every depth and length instead of loss by position "
        "(commands/retrieval.py)",
    )
    parser.add_argument("--lengths", help="--task: total tokens, e.g. 128K,1M (default: seq_len)")
    parser.add_argument("--depths", default=retrieval.DEFAULT_DEPTHS, help="--task: needle depths")
    parser.add_argument("--haystack", help="--task: .txt/.jsonl/.parquet (default: the job's data)")
    parser.add_argument("--samples", type=int, default=1, help="--task: prompts per cell")
    parser.add_argument("--digits", type=int, help="--task: value digits (default 5 / needle 7)")
    args, overrides = parser.parse_known_args(argv)
    if args.task:
        if args.tokens:
            parser.error("--tokens and --task are separate evaluations; pass one of them")
        request = retrieval.TaskRequest(
            args.task,
            args.lengths,
            args.depths,
            args.haystack,
            args.samples,
            args.digits,
            args.overwrite,
        )
        return run_main(lambda: retrieval.evaluate_task(args.config, request, overrides))
    if not args.tokens:
        parser.error("the following arguments are required: --tokens (or --task needle|passkey)")
    return run_main(lambda: evaluate(args.config, args.tokens, overrides, overwrite=args.overwrite))


def evaluate(
    config_file: str, tokens_file: str, overrides: list[str], *, overwrite: bool = False
) -> None:
    """Evaluate the job's weights on ``tokens_file``; rank 0 prints the JSON result line and
    writes the plot and JSON (``output_paths``)."""
    tokens = read_tokens(tokens_file)
    config = parse_args(["--config", config_file, *overrides])
    cp = config.parallelism.context_parallel_degree
    if tokens.shape[1] % cp:
        raise ConfigError(
            f"--tokens {tokens_file}: sequences of {tokens.shape[1]} tokens cannot be split "
            f"over context_parallel_degree = {cp}; cut them to a multiple of {cp}, e.g. "
            f"{tokens.shape[1] // cp * cp}"
        )
    config = dataclasses.replace(
        config, training=dataclasses.replace(config.training, seq_len=tokens.shape[1])
    )
    vocab = _vocab_size(config)
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ConfigError(
            f"--tokens {tokens_file}: token ids span [{tokens.min()}, {tokens.max()}], outside "
            f"the model's vocabulary [0, {vocab})"
        )
    folder = Path(config.job.dump_folder) / config.checkpoint.folder
    newest = snapshot_candidates(config, folder)[:1]  # the snapshot to expect: no process group yet
    expected = folder / f"step-{newest[0]}" if newest else None
    if not overwrite:
        refuse_existing(output_paths(config, tokens_file, expected), OUTPUT_FIX)
    built, snapshot, source = load_job_model(config)
    paths = output_paths(config, tokens_file, snapshot)
    if not overwrite and snapshot != expected:  # fell back to an older snapshot
        on_rank0(lambda: refuse_existing(paths, OUTPUT_FIX))
    rows, seq_len = tokens.shape
    sums = position_loss_sums(built, tokens)
    result = summarise(sums, rows)
    if dist.get_rank() == 0:
        title = (
            f"{Path(tokens_file).name}: {rows} x {seq_len:,} tokens, "
            f"{weights_tag(config, snapshot)} weights, {mask_tag(config)} mask, cp {built.setup.cp}"
        )
        record = {**result, "weights": source, "mask": mask_tag(config), "tokens": tokens_file}
        write_outputs(
            paths,
            record,
            lambda path: plot_loss_by_position(sums, rows, result, path, title),
            overwrite=overwrite,
        )
        logger.info(
            "evaluated %s on %d x %d tokens; wrote %s and %s", source, rows, seq_len, *paths
        )
        print(json.dumps(result), flush=True)  # the command's output: its result, one JSON line


def _vocab_size(config: JobConfig) -> int:
    try:
        return model_args(config.model, config.training.seq_len).vocab_size
    except ValueError as err:
        raise ConfigError(f"{config.config_file or 'command line'}: {err}") from err
