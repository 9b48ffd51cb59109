"""Peak memory of one attention layer under every CP style, CPU + gloo.

UPipe's claim is that running Ulysses a few heads at a time shrinks the query-side intermediates
(Q, the attention output and their all-to-all buffers) to about U/H of Ulysses' (see "Memory
bound" in ``upipe_dtensor/parallel/staged_attention.py``). The measured unit is the whole layer as
the model calls it: RoPE at the shard's positions, the attention op (projections, the stage loop,
the pre-``wo`` output buffer and ``wo``, which the op applies itself), and in backward every
gradient (dx, dwq, dwk, dwv, dwo). Rows: UPipe at U = C and 2C, Ulysses (U = H), ring attention,
FPDT (all heads, S cut into chunks) and UPipe x FPDT (U = C stages of chunks).

The stage loops run inside custom ops (``upipe::attention_*``, ``upipe::fpdt_*``), so a dispatch
mode would see only the ops' outputs. This script instead reads the profiler's allocator events
(``profile_memory=True``), which record CPU allocations and frees including the transient buffers
inside an op, puts back the frees made on gloo's worker thread (which the profiler misses; see
``live_memory.allocations``), and replays them in time order to get the peak of live bytes above
the level at the start of each region. FPDT's host buffers (chunks parked by
``runtime.host_store``) are the same CPU memory here; they are kept out of the device numbers (by
the frame that allocates them) and reported as what the store's pool grew by.

Run: ``python benchmarks/attention_memory.py`` (C=4 gloo processes, H=32, H_kv=8, d=16, S=16384:
4,096 tokens per rank against a width of 512, the proportions of long context, where a rank's
activations outgrow the weights' gradients; about 5 minutes on 2 busy cores). ``--checkpoint``
runs the layer under activation checkpointing, as the long-context recipes do: backward
recomputes the forward, whose saved output then holds the query gradients; without it backward
takes a buffer of the output's size for them.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from live_memory import (
    Allocation,
    MiB,
    RegionMemory,
    allocations,
    check_tracker,
    on_gloo_ranks,
    profiler,
    region,
    region_memory,
    split_events,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from upipe_dtensor.models import get_family, init_sharded_weights
from upipe_dtensor.parallel import registry
from upipe_dtensor.runtime.parity import cast_parameters

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FORWARD, BACKWARD, LAYER = "bench::forward", "bench::backward", "bench::layer"
HOST_BUFFER = "_host_buffer"
"""Label of the allocations ``runtime.host_store`` makes for parked tensors: host memory, counted
by the store itself (``host_bytes``) and kept out of the device numbers."""


# --- the benchmark ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One row: a CP style and its stage size U (``None``: the style's own) and FPDT chunks
    (0: whole-sequence stages)."""

    name: str
    style: str
    heads_per_stage: int | None = None
    chunks: int = 0

    @property
    def op(self) -> str:
        """The custom op whose forward/backward this style's attention runs in."""
        return "upipe::fpdt" if self.chunks else "upipe::attention"


@dataclass(frozen=True)
class Config:
    """The shapes and the rows to compare (Ulysses, U = n_heads, always among them)."""

    cp: int
    seq_len: int
    batch: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    variants: tuple[Variant, ...]
    checkpoint: bool = False
    """Run the layer as the long-context recipes do, under activation checkpointing: backward
    recomputes the forward (whose saved output then holds the query gradients)."""


@dataclass
class Phase:
    """Forward or backward of one row, device bytes, each the max over ranks.

    ``layer_*``: the whole module call (RoPE, the attention op with ``wo``, autograd's grads).
    ``op_*``: inside the attention op only, where the stage loop runs; ``op_returned`` is what the
    op hands back (forward: y, the saved pre-``wo`` output, LSEs; backward: dx, dwq, dwk, dwv,
    dwo). ``layer_live_at_peak``: bytes allocated in the region and live at its peak, by origin,
    on the rank with the largest peak.
    """

    layer_peak: int
    layer_kept: int
    op_peak: int
    op_returned: int
    layer_live_at_peak: dict[str, int]

    @property
    def working(self) -> int:
        """The layer's peak beyond what the op returns (backward: beyond the gradients)."""
        return self.layer_peak - self.op_returned


@dataclass
class Row:
    """One variant. ``peak``: the layer's device peak over forward and backward together, above
    the level before forward; ``host_peak``: what the style's host memory pool (FPDT's parked
    chunks) grew by in the layer; ``frees_put_back``: unrecorded frees that ``allocations``
    inferred (max over ranks)."""

    variant: Variant
    peak: int
    forward: Phase
    backward: Phase
    host_peak: int
    frees_put_back: int


def build_attention(cfg: Config) -> tuple[nn.Module, tuple, dict[str, Any]]:
    """A Llama3 attention layer, identical on every rank: this project's (the ``llama3``
    family's model class on the installed torchtitan generation, separate wq/wk/wv, RoPE as the
    float64 frequencies) with torchtitan's initial weights, in ``cfg``'s dtype; and the arguments
    its block passes it after ``x`` (the frequencies, no mask, no positions)."""
    family = get_family("llama3")
    args = family.args_class(
        dim=cfg.n_heads * cfg.head_dim,
        n_layers=1,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        vocab_size=8,  # the embeddings and the output layer are not measured (nor kept)
        max_seq_len=cfg.seq_len,
    )
    model = family.model_class(args)
    init_sharded_weights(model, seed=0, device=torch.device("cpu"))
    attention = model.layers["0"].attention
    cast_parameters(attention, DTYPES[cfg.dtype])  # the RoPE frequencies stay float64
    call_args, call_kwargs = model.block_arguments(None, None, None)
    return attention, call_args, call_kwargs


def _max_over_ranks(mine: RegionMemory) -> RegionMemory:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return max(gathered, key=lambda m: m.peak_bytes)


def _phase(events: list[Allocation], layer: tuple[int, int], op: tuple[int, int]) -> Phase:
    """This phase's numbers, each the max over ranks; the breakdown from the rank with that max."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (region_memory(events, *layer), region_memory(events, *op)))
    whole = max((w for w, _ in gathered), key=lambda m: m.peak_bytes)
    return Phase(
        layer_peak=whole.peak_bytes,
        layer_kept=max(w.end_bytes for w, _ in gathered),
        op_peak=max(i.peak_bytes for _, i in gathered),
        op_returned=max(i.end_bytes for _, i in gathered),
        layer_live_at_peak=whole.live_at_peak,
    )


def make_style(cfg: Config, variant: Variant):
    """The row's ParallelStyle, built through the registry: its ``style`` picks the class,
    ``chunks`` the sequence chunks (a "upipe" row with chunks is UPipe x FPDT, U query heads per
    stage over chunks)."""
    spec = registry.style_spec(variant.style)
    values: dict[str, Any] = {"cp_style": variant.style}
    if spec.takes("chunk_tokens"):
        values["chunk_tokens"] = cfg.seq_len // variant.chunks if variant.chunks else None
    if spec.takes("heads_per_stage"):
        values["heads_per_stage"] = variant.heads_per_stage
    return registry.make_style(values)


def measure(cfg: Config, variant: Variant, mesh: DeviceMesh) -> Row:
    """Profile one forward and one backward of a fresh layer in this variant."""
    dtype, dim = DTYPES[cfg.dtype], cfg.n_heads * cfg.head_dim
    style = make_style(cfg, variant)
    attention, args, kwargs = build_attention(cfg)
    attention = parallelize_module(attention, mesh, style)
    # Warm-up on a short shard, so one-off lazy allocations do not count as the layer's.
    attention(torch.randn(cfg.batch, 8, dim, dtype=dtype), *args, **kwargs).sum().backward()
    attention.zero_grad(set_to_none=True)

    torch.manual_seed(1 + dist.get_rank())
    local_len = cfg.seq_len // cfg.cp
    x = torch.randn(cfg.batch, local_len, dim, dtype=dtype, requires_grad=True)
    grad = torch.randn(cfg.batch, local_len, dim, dtype=dtype)
    host_before = _host_bytes(style)
    dist.barrier()
    with profiler() as prof, record_function(LAYER):
        with record_function(FORWARD):
            if cfg.checkpoint:
                out = checkpoint(attention, x, *args, use_reentrant=False, **kwargs)
            else:
                out = attention(x, *args, **kwargs)
        with record_function(BACKWARD):
            out.backward(grad)
    survivors = [out, x.grad, *(p.grad for p in attention.parameters())]
    events, put_back = allocations(prof, {t.untyped_storage().data_ptr() for t in survivors})
    _, device = split_events(events, lambda label: HOST_BUFFER in label)
    maxima = torch.tensor([put_back, _host_bytes(style) - host_before])
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    return Row(
        variant,
        _max_over_ranks(region_memory(device, *region(prof, LAYER))).peak_bytes,
        _phase(device, region(prof, FORWARD), region(prof, f"{variant.op}_fwd")),
        _phase(device, region(prof, BACKWARD), region(prof, f"{variant.op}_bwd")),
        int(maxima[1]),
        int(maxima[0]),
    )


def _host_bytes(style) -> int:
    """Host memory held by the style's stores: FPDT parks chunks in pooled host buffers, which
    are kept for the next layer, so what the pool grew by is the host memory this layer needed."""
    host = getattr(style, "host", None)
    return sum(store.host_bytes for store in host.stores.values()) if host else 0


def _rank_rows(rank: int, cfg: Config) -> list[dict]:
    """One CP rank: measure every variant in turn (ranks stay in step through the collectives)."""
    mesh = init_device_mesh("cpu", (cfg.cp,), mesh_dim_names=("cp",))
    return [asdict(measure(cfg, v, mesh)) for v in cfg.variants]


def run(cfg: Config) -> list[Row]:
    """The rows of rank 0 of C gloo ranks."""
    return [
        Row(
            Variant(**r["variant"]),
            r["peak"],
            Phase(**r["forward"]),
            Phase(**r["backward"]),
            r["host_peak"],
            r["frees_put_back"],
        )
        for r in on_gloo_ranks(cfg.cp, _rank_rows, cfg)
    ]


# --- reporting ----------------------------------------------------------------------------------


def analytic_sizes(cfg: Config) -> dict[str, int]:
    """Reference tensor sizes per rank in bytes (N = B*S/C local tokens)."""
    tokens = cfg.batch * cfg.seq_len // cfg.cp
    item = DTYPES[cfg.dtype].itemsize
    dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    sizes = {"x, y, out buffer or full Q, all heads (N*H*d)": tokens * dim * item}
    for u in sorted({v.heads_per_stage for v in cfg.variants if v.heads_per_stage}):
        sizes[f"one stage's Q at U={u} (N*U*d)"] = tokens * u * cfg.head_dim * item
    sizes["all of K (or V), H_kv heads (N*H_kv*d)"] = tokens * kv_dim * item
    sizes["gradients backward returns (dx, dwq..dwo)"] = (
        tokens * dim + 2 * dim * dim + 2 * dim * kv_dim
    ) * item
    return sizes


def _table(title: str, columns: list[str], rows: list[tuple[str, list[float]]]) -> None:
    print(title)
    header = f"{'config':<30}" + "".join(f"{c:>12}" for c in columns)
    print(header)
    print("-" * len(header))
    for name, values in rows:
        print(f"{name:<30}" + "".join(f"{v:>12.2f}" for v in values))
    print()


def _ulysses(cfg: Config, rows: list[Row]) -> Row:
    """The reference row: UPipe with every head in one stage."""
    return next(
        r
        for r in rows
        if r.variant.style == "upipe"
        and not r.variant.chunks
        and r.variant.heads_per_stage == cfg.n_heads
    )


def markdown_table(cfg: Config, rows: list[Row]) -> str:
    """The table of docs/memory-stack.md (MiB, ratios against Ulysses): the README's and the
    docs' numbers are this output, and tests/test_documented_numbers.py compares them."""
    ulysses = _ulysses(cfg, rows)
    lines = [
        "| style | layer peak, fwd + bwd | fwd peak | kept after fwd | bwd peak "
        "| bwd peak less gradients | host |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        reference = r is ulysses
        peak = f"{r.peak / MiB:.1f}" + ("" if reference else f" ({r.peak / ulysses.peak:.2f}x)")
        working = f"{r.backward.working / MiB:.1f}" + (
            "" if reference else f" ({r.backward.working / ulysses.backward.working:.2f}x)"
        )
        host = f"{r.host_peak / MiB:.1f}" if r.host_peak else ""
        lines.append(
            f"| {r.variant.name} | {peak} | {r.forward.layer_peak / MiB:.1f} | "
            f"{r.forward.layer_kept / MiB:.1f} | {r.backward.layer_peak / MiB:.1f} | {working} | "
            f"{host} |"
        )
    return "\n".join(lines)


def print_report(cfg: Config, rows: list[Row], breakdown: int, seconds: float) -> None:
    ulysses = _ulysses(cfg, rows)
    print(
        f"One attention layer, C={cfg.cp} gloo ranks, B={cfg.batch}, S={cfg.seq_len} "
        f"({cfg.seq_len // cfg.cp} per rank), H={cfg.n_heads}, H_kv={cfg.n_kv_heads}, "
        f"d={cfg.head_dim}, {cfg.dtype}"
        f"{', under activation checkpointing' if cfg.checkpoint else ''}.\n"
        "MiB of live CPU allocations above the level at the "
        f"start of each region, max over ranks.\n"
    )
    _table(
        "Whole layer (x ready -> y; y.backward(grad) -> every gradient exists)",
        [
            "layer peak",
            "vs Ulysses",
            "fwd peak",
            "fwd kept",
            "bwd peak",
            "bwd - grads",
            "vs Ulysses",
            "host peak",
        ],
        [
            (
                r.variant.name,
                [
                    r.peak / MiB,
                    r.peak / ulysses.peak,
                    r.forward.layer_peak / MiB,
                    r.forward.layer_kept / MiB,
                    r.backward.layer_peak / MiB,
                    r.backward.working / MiB,
                    r.backward.working / ulysses.backward.working,
                    r.host_peak / MiB,
                ],
            )
            for r in rows
        ],
    )
    print(
        "layer peak: forward and backward together, above the level before forward. fwd kept: "
        "still live when\nforward returns (y, the op's saved pre-wo output, LSEs). bwd peak: "
        "above the level at the start of\nbackward (which includes fwd kept); bwd - grads: "
        "less the gradients backward returns (dx, dwq..dwo:\nthe same in every row). host "
        "peak: FPDT's parked chunks (host memory on a GPU).\n"
        f"Frees missed by the profiler (gloo worker thread) and put back, max per row: "
        f"{', '.join(str(r.frees_put_back) for r in rows)}."
        "\nReference sizes per rank:"
    )
    for name, nbytes in analytic_sizes(cfg).items():
        print(f"  {name:<46}{nbytes / MiB:>8.2f} MiB")
    for row in rows if breakdown else []:
        for phase, data in (("forward", row.forward), ("backward", row.backward)):
            print(f"\n{row.variant.name} {phase}, live at the layer peak:")
            for label, nbytes in list(data.layer_live_at_peak.items())[:breakdown]:
                print(f"  {nbytes / MiB:>8.2f} MiB  {label}")
    print(f"\nAs in docs/memory-stack.md:\n{markdown_table(cfg, rows)}")
    print(f"\n({seconds:.0f} s)")


def rows_from_json(report: dict) -> tuple[Config, list[Row]]:
    """The config and rows of a ``--json`` report."""
    config = dict(report["config"])
    config["variants"] = tuple(Variant(**v) for v in config["variants"])
    rows = [
        Row(
            Variant(**r["variant"]),
            r["peak"],
            Phase(**r["forward"]),
            Phase(**r["backward"]),
            r["host_peak"],
            r["frees_put_back"],
        )
        for r in report["rows"]
    ]
    return Config(**config), rows


def default_variants(
    cp: int, n_heads: int, stage_sizes: list[int], fpdt_chunks: list[int]
) -> tuple[Variant, ...]:
    """UPipe at each U (Ulysses, U = H, always), ring, FPDT and UPipe x FPDT (U = C) at each
    chunk count."""
    rows = []
    for u in sorted(set(stage_sizes) | {n_heads}):
        name = (
            f"Ulysses, U = H = {u}"
            if u == n_heads
            else f"UPipe, U = C = {u}"
            if u == cp
            else f"UPipe, U = {u}"
        )
        rows.append(Variant(name, "upipe", u))
    rows.append(Variant("ring attention", "ring"))
    rows += [Variant(f"FPDT, {c} chunks", "fpdt", n_heads, c) for c in fpdt_chunks]
    rows += [Variant(f"UPipe x FPDT, U = C, {c} chunks", "upipe", cp, c) for c in fpdt_chunks]
    return tuple(rows)


def parse_args() -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=4, help="context-parallel degree C (processes)")
    parser.add_argument("--seq-len", type=int, default=16384, help="total sequence length S")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--n-heads", type=int, default=32)
    parser.add_argument("--n-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument(
        "--stage-sizes",
        type=int,
        nargs="+",
        default=None,
        help="UPipe's heads per stage U to compare (default: C, 2C; H is always added)",
    )
    parser.add_argument(
        "--fpdt-chunks",
        type=int,
        nargs="*",
        default=[2, 4],
        help="sequence chunks of the FPDT and UPipe x FPDT rows (none: no such rows)",
    )
    parser.add_argument(
        "--breakdown",
        type=int,
        default=0,
        metavar="N",
        help="also print the N largest origins of live bytes at each layer peak",
    )
    parser.add_argument(
        "--checkpoint",
        action="store_true",
        help="run the layer under activation checkpointing, as the long-context recipes do",
    )
    parser.add_argument("--json", action="store_true", help="print results as JSON instead")
    args = parser.parse_args()
    if args.seq_len % args.cp:
        parser.error(f"--seq-len {args.seq_len} must be divisible by --cp {args.cp}")
    variants = default_variants(
        args.cp, args.n_heads, args.stage_sizes or [args.cp, 2 * args.cp], args.fpdt_chunks
    )
    cfg = Config(
        args.cp,
        args.seq_len,
        args.batch,
        args.n_heads,
        args.n_kv_heads,
        args.head_dim,
        args.dtype,
        variants,
        args.checkpoint,
    )
    return cfg, args


def main() -> None:
    cfg, args = parse_args()
    check_tracker()
    start = time.perf_counter()
    rows = run(cfg)
    seconds = time.perf_counter() - start
    if args.json:
        print(
            json.dumps(
                {
                    "config": asdict(cfg),
                    "analytic_bytes": analytic_sizes(cfg),
                    "rows": [asdict(r) for r in rows],
                },
                indent=2,
            )
        )
    else:
        print_report(cfg, rows, args.breakdown, seconds)


if __name__ == "__main__":
    main()
