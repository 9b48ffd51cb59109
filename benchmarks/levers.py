"""What each speed lever buys Llama3-8B UPipe on 8 x H100, predicted by the planner's step-time
model from traced plans (no GPU measurement): central values and their bands, and the ratio to
the model's own price of the paper's stack (not to the paper's measurement, which carries the
model's error at that length: ``benchmarks/paper_throughput.py`` compares the two).

For each length the UPipe recipe is planned with the paper's stack (FA3, model states on the GPU,
each all-to-all waited for at once: ``benchmarks/paper_throughput.py``) and priced as the paper's
code runs it (block inputs copied on the compute stream, ``save_on_cpu``), then with one lever
more at a time:

- kernel: the same counted work priced with FlashAttention-2's rates instead of FA3's (what this
  repository ran before FA3, and what the paper's stack gains over it);
- offload: this repository's block-input offload, on side streams (prefetched where the recipe
  prefetches), instead of the paper's copies on the compute stream;
- overlap: ``[parallelism] overlap_stages = true``, the next stage's all-to-alls during this
  stage's attention;
- kept attention: ``[activation_checkpoint] keep_attention``, on the device where that fits, else
  on the host; where neither fits for every block, in as many of the last blocks as fit, as
  ``plan --objective speed --search keep_attention,kept_layers`` chooses (the row says which);
- compiled blocks: ``[compile] enable = true`` (the recipes' default; the paper's code runs
  eager), planned from the graphs inductor compiles (``planning.compiled``): its fused kernels'
  bytes and launches instead of the eager ops'.

Each step keeps the previous ones. The peak per GPU of every plan is printed with its speed, and
a plan that does not fit on 80 GiB (or in 2 TiB of host per node) says so; "vs the paper's stack"
is the fastest plan that fits against the first FA3 column, both ends of its band priced at the
same ends of the same ranges (``step_time.speedup``).

    python benchmarks/levers.py                      # 128K, 1M, 5M (~25 min on 2 CPU cores)
    python benchmarks/levers.py --lengths 128K
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from upipe_dtensor.config import JobConfig, parse_args
from upipe_dtensor.models.hf_config import model_args
from upipe_dtensor.planning.hardware import GPU_PROFILES
from upipe_dtensor.planning.max_context import find_max_context
from upipe_dtensor.planning.step import Budget, Plan, plan_job
from upipe_dtensor.planning.step_time import StepTime, predict_step_time

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from paper_throughput import LENGTHS, PAPER, PAPER_STACK, band, ratio  # noqa: E402

GiB = 2**30


def config(length: str, *overrides: str) -> JobConfig:
    recipe = REPO / "recipes" / f"llama3_8b_{length}.toml"
    return parse_args(["--config", str(recipe), *PAPER_STACK, *overrides])


def plan(length: str, *overrides: str) -> Plan:
    return plan_job(config(length, *overrides))


def kept_in_some_blocks(length: str, *overrides: str) -> tuple[Plan, str, JobConfig]:
    """The fastest kept attention that fits, in the last blocks only (the speed search)."""
    found = find_max_context(
        config(length, *overrides),
        Budget(),
        search=["keep_attention", "kept_layers"],
        objective="speed",
    )
    checkpointing = found.config.activation_checkpoint
    where = checkpointing.keep_attention
    if where != "none":
        n_layers = model_args(found.config.model, found.seq_len).n_layers
        where += f", last {n_layers - checkpointing.keep_attention_skip_first} blocks"
    return found.plan, where, found.config


def compiled(kept: JobConfig) -> Plan:
    """The kept-attention job with its blocks compiled."""
    return plan_job(
        dataclasses.replace(kept, compile=dataclasses.replace(kept.compile, enable=True))
    )


def repriced(planned: Plan, **changes) -> StepTime:
    """The plan's counted work priced again with ``changes`` to its shape."""
    speed = planned.speed
    shape = dataclasses.replace(speed.shape, **changes)
    return predict_step_time(speed.counted, shape, GPU_PROFILES[planned.budget.gpu])


def row(length: str) -> str:
    paper = PAPER[("8B", "upipe")][LENGTHS.index(length)]
    base = plan(length)
    papers_stack = repriced(base, offload_on_compute_stream=True)
    fa2 = repriced(base, offload_on_compute_stream=True, backend="flash")
    overlapped = plan(length, "--parallelism.overlap_stages", "true")
    overlap = ["--parallelism.overlap_stages", "true"]
    for where in ("device", "host"):
        kept_config = config(length, *overlap, "--activation_checkpoint.keep_attention", where)
        kept = plan_job(kept_config)
        if kept.fits:
            break
    else:  # on the stack that fits, as many of the last blocks as fit
        kept, where, kept_config = kept_in_some_blocks(
            length, *(overlap if overlapped.fits else [])
        )
    fused = compiled(kept_config)
    best = max((p for p in (base, overlapped, kept, fused) if p.fits), key=_speed, default=base)
    return (
        f"| {length} | {paper:.2f} | {band(fa2)} | {band(papers_stack)} | {_cell(base)} "
        f"| {_cell(overlapped)} | {_cell(kept, where)} | {_cell(fused)} "
        f"| {ratio(best.speed, papers_stack)} |"
    )


def _speed(planned: Plan) -> float:
    return planned.speed.tokens_per_s_per_gpu


def _cell(planned: Plan, where: str = "") -> str:
    """Tokens/s per GPU (band), and the peak per GPU (with what it says when it does not fit)."""
    notes = [where] if where else []
    notes.append(f"{planned.device_peak_bytes / GiB:.1f} GiB")
    if not planned.fits:
        notes.append("does not fit")
    return f"{band(planned.speed)}, {', '.join(notes)}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", nargs="+", default=["128K", "1M", "5M"], choices=LENGTHS)
    args = parser.parse_args(argv)
    print(
        "Predicted tokens/s per GPU (step-time model, h100-sxm profile), not GPU measurements: "
        "central value (band: every constant at the slow, then the fast end of its range).\n"
    )
    print(
        "| length | paper UPipe, measured | FA2 | FA3, the paper's stack | + side-stream offload "
        "(peak) | + overlapped stages | + kept attention | + compiled blocks "
        "| vs the paper's stack (model) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for length in args.lengths:
        print(row(length), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
