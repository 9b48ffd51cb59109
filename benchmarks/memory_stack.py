"""Peak live memory of one training step under each piece of the memory stack, CPU + gloo.

Each configuration builds the real ``Trainer`` (FSDP2 + UPipe over C gloo ranks) for the small
``debugmodel`` Llama3 and runs one full step first (``train_step``: forward, backward, optimizer
step), so one-time allocations (optimizer states, HostOffload's pooled host buffers) exist before
the measurement. The forward + backward of the next batch is then profiled, and the allocator
events are replayed (``live_memory``) to get the peak of live bytes above the level at the step's
start: the activations, gradients and transient buffers that the memory stack is meant to shrink.

On CPU, host memory is device memory. HostOffload copies checkpointed block inputs (all blocks'
but the last, ``cpu_offload_skip_last = 1``) into pooled host buffers allocated in the first step
and kept across steps, so they are part of the level at the step's start, not of the per-step
peak: the offload rows show bytes moved out of the step's working set, not bytes the process
saves. The device/host split is what the memory planner shows on fake CUDA. FSDP2's CPU offload
(parameters, gradients, optimizer state) is not measured here.

Run: ``python benchmarks/memory_stack.py`` (C=2 gloo processes, S=8192 tokens in total: about
2 minutes on 2 cores; ``--seq-len 16384`` takes about 5, attention's cost growing as S^2).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from live_memory import (
    CODE_OF_INTEREST,
    MiB,
    RegionMemory,
    allocations,
    check_tracker,
    on_gloo_ranks,
    profiler,
    region,
    region_memory,
)
from timing_overrides import TIMING_RUN
from torch.profiler import record_function

from upipe_dtensor.config import parse_args
from upipe_dtensor.models import build_llama3
from upipe_dtensor.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
STEP, FORWARD = "bench::step", "bench::forward"
# Label allocations by torchtitan's model code and FSDP2 too, not by the nn.Module call around them.
CODE = re.compile(rf"{CODE_OF_INTEREST.pattern}|torchtitan|torch/distributed/fsdp|memory_stack")


@dataclass(frozen=True)
class Setup:
    """The shapes and the tile / chunk sizes shared by every configuration."""

    cp: int
    seq_len: int
    batch: int
    mlp_tile_tokens: int
    loss_chunk_tokens: int


@dataclass
class Row:
    """One configuration, bytes, each the max over ranks. ``peak``: live above the step's start;
    ``forward_kept``: still live when the forward returns (what backward holds on to);
    ``host_offload``: HostOffload's ``peak_host_bytes`` (None without offload);
    ``live_at_peak``: bytes live at the peak by origin, on the rank with the largest peak;
    ``frees_put_back``: frees the profiler missed (gloo's thread) that ``allocations`` inferred."""

    name: str
    overrides: list[str]
    peak: int
    forward_kept: int
    host_offload: int | None
    live_at_peak: dict[str, int]
    frees_put_back: int


def configurations(setup: Setup) -> dict[str, list[str]]:
    """Config overrides of each measured configuration, plain first (the reference)."""
    checkpoint = ["--activation_checkpoint.mode", "full"]
    offload = [*checkpoint, "--activation_checkpoint.cpu_offload", "true"]
    tiled = ["--memory.tiled_mlp", "true", "--memory.mlp_tile_tokens", str(setup.mlp_tile_tokens)]
    norm = ["--memory.tiled_rms_norm", "true"]
    chunked = [
        "--memory.chunked_loss",
        "true",
        "--memory.loss_chunk_tokens",
        str(setup.loss_chunk_tokens),
    ]
    return {
        "plain": [],
        "+checkpoint": checkpoint,
        "+checkpoint+host offload": offload,
        "+tiled MLP": tiled,
        "+tiled RMSNorm": norm,
        "+chunked loss": chunked,
        "all": [*offload, *tiled, *norm, *chunked],
        # each block compiled (fullgraph, inductor), as the GPU recipes run
        "all, compiled": [*offload, *tiled, *norm, *chunked, "--compile.enable", "true"],
    }


def _job(setup: Setup, dump_folder: str, overrides: list[str]) -> list[str]:
    """Command line of the debug job at this sequence length, with absolute asset paths so the
    script runs from any directory."""
    return [
        "--config",
        str(REPO / "train_configs/debug_model.toml"),
        "--job.dump_folder",
        dump_folder,
        "--model.tokenizer_path",
        str(REPO / "assets/tokenizer"),
        "--training.dataset_path",
        str(REPO / "assets/corpus"),
        "--training.seq_len",
        str(setup.seq_len),
        "--training.local_batch_size",
        str(setup.batch),
        "--parallelism.context_parallel_degree",
        str(setup.cp),
        *TIMING_RUN,
        *overrides,
    ]


def _storages(*tensors: torch.Tensor | None) -> set[int]:
    """Storage pointers of these tensors (local shards of DTensors)."""
    found: set[int] = set()
    for tensor in tensors:
        if tensor is not None:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            found.add(local.untyped_storage().data_ptr())
    return found


def measure(setup: Setup, name: str, overrides: list[str], dump_folder: str) -> Row:
    """Warm up with one optimizer step, then profile forward + backward of the next batch."""
    trainer = Trainer(parse_args(_job(setup, dump_folder, overrides)))
    batches = iter(trainer.dataloader)
    trainer.train_step([next(batches)])
    inputs, labels = (trainer.shard_sequence(t) for t in next(batches))
    # Collect earlier garbage now: FSDP and checkpoint wrappers hold reference cycles, and their
    # frees inside the measured step would lower the level below the step's start.
    gc.collect()
    dist.barrier()
    with profiler() as prof, record_function(STEP):
        with record_function(FORWARD):
            loss = trainer.parallel(inputs, labels=labels)
        loss.backward()
    params = list(trainer.model.parameters())
    alive = _storages(loss, *params, *(p.grad for p in params))
    events, put_back = allocations(prof, alive, CODE)
    mine = (
        region_memory(events, *region(prof, STEP)),
        region_memory(events, *region(prof, FORWARD)).end_bytes,
        trainer.host_offload.peak_host_bytes if trainer.host_offload else None,
        put_back,
    )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    step: RegionMemory = max((g[0] for g in gathered), key=lambda m: m.peak_bytes)
    hosts = [g[2] for g in gathered if g[2] is not None]
    return Row(
        name,
        overrides,
        step.peak_bytes,
        max(g[1] for g in gathered),
        max(hosts) if hosts else None,
        step.live_at_peak,
        max(g[3] for g in gathered),
    )


def _rank_rows(rank: int, setup: Setup) -> list[dict]:
    """One CP rank: every configuration in turn, each with a fresh Trainer."""
    with tempfile.TemporaryDirectory() as dump_folder:
        return [
            asdict(measure(setup, name, overrides, dump_folder))
            for name, overrides in configurations(setup).items()
        ]


def run(setup: Setup) -> list[Row]:
    """The rows of rank 0 of C gloo ranks."""
    return [Row(**r) for r in on_gloo_ranks(setup.cp, _rank_rows, setup)]


# --- reporting ----------------------------------------------------------------------------------


def reference_sizes(setup: Setup) -> dict[str, int]:
    """Per-rank tensor sizes in bytes (N = B*S/C local tokens, float32 on CPU) to read peaks by."""
    with torch.device("meta"):
        model = build_llama3("debugmodel", seq_len=setup.seq_len)
    args = model.model_args
    hidden = model.layers["0"].feed_forward.w1.weight.shape[0]
    tokens = setup.batch * setup.seq_len // setup.cp
    return {
        f"hidden state h (N x D = {tokens} x {args.dim})": tokens * args.dim * 4,
        f"MLP hidden (N x F, F = {hidden})": tokens * hidden * 4,
        f"logits (N x V, V = {args.vocab_size})": tokens * args.vocab_size * 4,
        f"one loss chunk's logits ({setup.loss_chunk_tokens} x V)": min(
            tokens, setup.loss_chunk_tokens
        )
        * args.vocab_size
        * 4,
    }


def markdown_table(rows: list[Row]) -> str:
    """The table of docs/memory-stack.md (MiB): the docs' numbers are this output, and
    tests/test_documented_numbers.py compares them."""
    plain = rows[0]
    lines = [
        "| configuration | peak | vs plain | kept after forward | host offload |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        host = f"{row.host_offload / MiB:.1f}" if row.host_offload is not None else ""
        lines.append(
            f"| {row.name} | {row.peak / MiB:.1f} | {row.peak / plain.peak:.2f} | "
            f"{row.forward_kept / MiB:.1f} | {host} |"
        )
    return "\n".join(lines)


def print_report(setup: Setup, rows: list[Row], breakdown: int, seconds: float) -> None:
    plain = rows[0]
    print(
        f"One training step (forward + backward, after a warm-up step) of the debugmodel Llama3, "
        f"C={setup.cp} gloo ranks (UPipe + FSDP2), B={setup.batch}, S={setup.seq_len} "
        f"({setup.seq_len // setup.cp} per rank), float32.\nMiB of live CPU allocations above "
        f"the level at the step's start, max over ranks.\n"
    )
    header = (
        f"{'configuration':<26}{'peak MiB':>10}{'vs plain':>10}{'fwd kept':>10}{'host MiB':>10}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        host = f"{row.host_offload / MiB:>10.2f}" if row.host_offload is not None else f"{'-':>10}"
        print(
            f"{row.name:<26}{row.peak / MiB:>10.2f}{row.peak / plain.peak:>10.2f}"
            f"{row.forward_kept / MiB:>10.2f}{host}"
        )
    print(
        "\nfwd kept: live when forward returns (what backward holds on to).\n"
        "host MiB: HostOffload's peak_host_bytes. On CPU, host memory is this same memory: the "
        "pooled host\nbuffers are allocated in the warm-up step and kept across steps, so they "
        "are in the level at the\nstep's start, outside the peak. The offload moves bytes out "
        "of the step's working set; it does not\nshrink the process. The memory planner shows "
        "the device/host split on fake CUDA."
    )
    print(
        f"Frees missed by the profiler (gloo worker thread) and put back, max per row: "
        f"{', '.join(str(r.frees_put_back) for r in rows)}.\nReference sizes per rank:"
    )
    for name, nbytes in reference_sizes(setup).items():
        print(f"  {name:<44}{nbytes / MiB:>8.2f} MiB")
    if breakdown:
        print("\nLargest origins of the bytes live at each peak (allocated during the step):")
        for row in rows:
            print(f"{row.name}:")
            for label, nbytes in list(row.live_at_peak.items())[:breakdown]:
                print(f"  {nbytes / MiB:>8.2f} MiB  {label}")
    print(f"\nAs in docs/memory-stack.md:\n{markdown_table(rows)}")
    print(f"\n({seconds:.0f} s)")


def parse_cli() -> tuple[Setup, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=2, help="context-parallel degree C (processes)")
    parser.add_argument("--seq-len", type=int, default=8192, help="total sequence length S")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument(
        "--mlp-tile-tokens",
        type=int,
        default=0,
        help="tokens per tiled-MLP tile (0: the model width)",
    )
    parser.add_argument(
        "--loss-chunk-tokens", type=int, default=1024, help="tokens per chunked-loss chunk"
    )
    parser.add_argument(
        "--breakdown",
        type=int,
        default=3,
        metavar="N",
        help="print the N largest origins of live bytes at each peak (0: none)",
    )
    parser.add_argument("--json", action="store_true", help="print results as JSON instead")
    args = parser.parse_args()
    if args.seq_len % args.cp:
        parser.error(f"--seq-len {args.seq_len} must be divisible by --cp {args.cp}")
    setup = Setup(args.cp, args.seq_len, args.batch, args.mlp_tile_tokens, args.loss_chunk_tokens)
    return setup, args


def main() -> None:
    setup, args = parse_cli()
    check_tracker()
    start = time.perf_counter()
    rows = run(setup)
    seconds = time.perf_counter() - start
    if args.json:
        print(
            json.dumps(
                {
                    "setup": asdict(setup),
                    "reference_bytes": reference_sizes(setup),
                    "rows": [asdict(r) for r in rows],
                },
                indent=2,
            )
        )
    else:
        print_report(setup, rows, args.breakdown, seconds)


if __name__ == "__main__":
    main()
