"""Peak memory inside one attention layer: UPipe (U = C, 2C) versus Ulysses (U = H), CPU + gloo.

UPipe's claim is that running Ulysses a few heads at a time shrinks the query-side intermediates
(Q, the attention output and their all-to-all buffers) to about U/H of Ulysses' (see "Memory
bound" in ``upipe_dtensor/parallel/upipe_attention.py``). The stage loop runs inside the custom op
``upipe::attention_fwd`` / ``attention_bwd``, so a dispatch mode would see only the op's outputs.
This script instead reads the profiler's allocator events (``profile_memory=True``), which record
CPU allocations and frees including the transient buffers inside the op, puts back the frees made
on gloo's worker thread (which the profiler misses; see ``live_memory.allocations``), and replays
them in time order to get the peak of live bytes above the level at the start of each region.

Run: ``python benchmarks/attention_memory.py`` (C=4 gloo processes, H=32, H_kv=8, d=64, S=8192).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.profiler import record_function
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import Attention, precompute_freqs_cis

from live_memory import (MiB, Allocation, allocations, check_tracker, on_gloo_ranks, profiler,
                         region, region_memory)
from upipe_dtensor.parallel.style import UPipeAttention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FORWARD, BACKWARD = "bench::forward", "bench::backward"


# --- the benchmark ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """The shapes and the stage sizes U to compare (Ulysses, U = n_heads, always among them)."""

    cp: int
    seq_len: int
    batch: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    stage_sizes: tuple[int, ...]


@dataclass
class Phase:
    """Forward or backward of one U, in bytes, each the max over ranks.

    ``layer_*``: the whole module call (projections, the UPipe op, ``wo``, autograd's grads).
    ``op_*``: inside the ``upipe::attention_*`` op only, where the stage loop runs; ``op_returned``
    is what the op hands back (forward: out buffer + LSEs; backward: dx, dwq, dwk, dwv), so
    ``op_peak - op_returned`` is the loop's working memory. ``*_live_at_peak``: bytes allocated
    in the region and live at its peak, by origin, on the rank with the largest peak.
    """

    layer_peak: int
    layer_kept: int
    op_peak: int
    op_returned: int
    layer_live_at_peak: dict[str, int]
    op_live_at_peak: dict[str, int]

    @property
    def op_transient(self) -> int:
        return self.op_peak - self.op_returned


@dataclass
class Row:
    """One U; ``frees_put_back``: unrecorded frees that ``allocations`` inferred (max over ranks)."""

    heads_per_stage: int
    forward: Phase
    backward: Phase
    frees_put_back: int


def build_attention(cfg: Config) -> Attention:
    """A torchtitan Llama3 attention layer, identical on every rank."""
    args = TransformerModelArgs(dim=cfg.n_heads * cfg.head_dim, n_heads=cfg.n_heads,
                                n_kv_heads=cfg.n_kv_heads, max_seq_len=cfg.seq_len)
    torch.manual_seed(0)
    attention = Attention(args)
    with torch.no_grad():
        attention.init_weights(0.02)
    return attention.to(DTYPES[cfg.dtype])


def _phase(events: list[Allocation], layer: tuple[int, int], op: tuple[int, int]) -> Phase:
    """This phase's numbers, each the max over ranks; breakdowns from the rank with that max."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (region_memory(events, *layer), region_memory(events, *op)))
    whole = max((w for w, _ in gathered), key=lambda m: m.peak_bytes)
    inner = max((i for _, i in gathered), key=lambda m: m.peak_bytes)
    return Phase(
        layer_peak=whole.peak_bytes,
        layer_kept=max(w.end_bytes for w, _ in gathered),
        op_peak=inner.peak_bytes,
        op_returned=max(i.end_bytes for _, i in gathered),
        layer_live_at_peak=whole.live_at_peak,
        op_live_at_peak=inner.live_at_peak,
    )


def measure(cfg: Config, heads_per_stage: int, mesh: DeviceMesh, freqs_cis: torch.Tensor) -> Row:
    """Profile one forward and one backward of a fresh layer at this U."""
    dtype, dim = DTYPES[cfg.dtype], cfg.n_heads * cfg.head_dim
    attention = parallelize_module(build_attention(cfg), mesh,
                                   UPipeAttention(heads_per_stage=heads_per_stage))
    # Warm-up on a short shard, so one-off lazy allocations do not count as the layer's.
    attention(torch.randn(cfg.batch, 8, dim, dtype=dtype), freqs_cis).sum().backward()
    attention.zero_grad(set_to_none=True)

    torch.manual_seed(1 + dist.get_rank())
    local_len = cfg.seq_len // cfg.cp
    x = torch.randn(cfg.batch, local_len, dim, dtype=dtype, requires_grad=True)
    grad = torch.randn(cfg.batch, local_len, dim, dtype=dtype)
    dist.barrier()
    with profiler() as prof:
        with record_function(FORWARD):
            out = attention(x, freqs_cis)
        with record_function(BACKWARD):
            out.backward(grad)
    survivors = [out, x.grad, *(p.grad for p in attention.parameters())]
    events, put_back = allocations(prof, {t.untyped_storage().data_ptr() for t in survivors})
    put_back_max = torch.tensor(put_back)
    dist.all_reduce(put_back_max, op=dist.ReduceOp.MAX)
    return Row(
        heads_per_stage,
        _phase(events, region(prof, FORWARD), region(prof, "upipe::attention_fwd")),
        _phase(events, region(prof, BACKWARD), region(prof, "upipe::attention_bwd")),
        int(put_back_max),
    )


def _rank_rows(rank: int, cfg: Config) -> list[dict]:
    """One CP rank: measure every U in turn (ranks stay in step through the collectives)."""
    mesh = init_device_mesh("cpu", (cfg.cp,), mesh_dim_names=("cp",))
    freqs_cis = precompute_freqs_cis(cfg.head_dim, cfg.seq_len, 500000.0)
    return [asdict(measure(cfg, u, mesh, freqs_cis)) for u in cfg.stage_sizes]


def run(cfg: Config) -> list[Row]:
    """The rows of rank 0 of C gloo ranks."""
    return [Row(r["heads_per_stage"], Phase(**r["forward"]), Phase(**r["backward"]),
                r["frees_put_back"]) for r in on_gloo_ranks(cfg.cp, _rank_rows, cfg)]


# --- reporting ----------------------------------------------------------------------------------


def analytic_sizes(cfg: Config) -> dict[str, int]:
    """Reference tensor sizes per rank in bytes (N = B*S/C local tokens)."""
    tokens = cfg.batch * cfg.seq_len // cfg.cp
    item = DTYPES[cfg.dtype].itemsize
    sizes = {"x, out buffer or full Q, all heads (N*H*d)":
             tokens * cfg.n_heads * cfg.head_dim * item}
    for u in cfg.stage_sizes:
        sizes[f"one stage's Q at U={u} (N*U*d)"] = tokens * u * cfg.head_dim * item
    sizes["all of K (or V), H_kv heads (N*H_kv*d)"] = tokens * cfg.n_kv_heads * cfg.head_dim * item
    sizes["wq (H*d x H*d)"] = (cfg.n_heads * cfg.head_dim) ** 2 * item
    return sizes


def _name(cfg: Config, heads_per_stage: int) -> str:
    if heads_per_stage == cfg.n_heads:
        return "U=H (Ulysses)"
    if heads_per_stage == cfg.cp:
        return "U=C (UPipe)"
    return f"U={heads_per_stage // cfg.cp}C ({heads_per_stage})"


def _table(title: str, columns: list[str], rows: list[tuple[str, list[float]]]) -> None:
    print(title)
    header = f"{'config':<16}" + "".join(f"{c:>12}" for c in columns)
    print(header)
    print("-" * len(header))
    for name, values in rows:
        print(f"{name:<16}" + "".join(f"{v:>12.2f}" for v in values))
    print()


def print_report(cfg: Config, rows: list[Row], breakdown: int, seconds: float) -> None:
    ulysses = next(r for r in rows if r.heads_per_stage == cfg.n_heads)
    print(f"One attention layer, C={cfg.cp} gloo ranks, B={cfg.batch}, S={cfg.seq_len} "
          f"({cfg.seq_len // cfg.cp} per rank), H={cfg.n_heads}, H_kv={cfg.n_kv_heads}, "
          f"d={cfg.head_dim}, {cfg.dtype}.\nMiB of live CPU allocations above the level at the "
          f"start of each region, max over ranks.\n")
    _table("Whole layer (x ready -> output; output.backward(grad) -> grads exist)",
           ["fwd peak", "bwd peak", "fwd/Ulysses", "bwd/Ulysses", "fwd kept"],
           [(_name(cfg, r.heads_per_stage),
             [r.forward.layer_peak / MiB, r.backward.layer_peak / MiB,
              r.forward.layer_peak / ulysses.forward.layer_peak,
              r.backward.layer_peak / ulysses.backward.layer_peak,
              r.forward.layer_kept / MiB]) for r in rows])
    _table("Inside the upipe op (stage loop); transient = peak - what the op returns",
           ["fwd peak", "fwd trans", "bwd peak", "bwd trans", "fwd tr/Uly", "bwd tr/Uly"],
           [(_name(cfg, r.heads_per_stage),
             [r.forward.op_peak / MiB, r.forward.op_transient / MiB,
              r.backward.op_peak / MiB, r.backward.op_transient / MiB,
              r.forward.op_transient / ulysses.forward.op_transient,
              r.backward.op_transient / ulysses.backward.op_transient]) for r in rows])
    print("fwd kept: still live when forward returns (wo output, the op's saved out buffer, LSEs)."
          f"\nFrees missed by the profiler (gloo worker thread) and put back, max per U: "
          f"{', '.join(str(r.frees_put_back) for r in rows)}."
          "\nReference sizes per rank:")
    for name, nbytes in analytic_sizes(cfg).items():
        print(f"  {name:<44}{nbytes / MiB:>8.2f} MiB")
    for row in rows if breakdown else []:
        for phase, data in (("forward", row.forward), ("backward", row.backward)):
            for where, live in (("layer", data.layer_live_at_peak), ("op", data.op_live_at_peak)):
                print(f"\n{_name(cfg, row.heads_per_stage)} {phase}, live at the {where} peak:")
                for label, nbytes in list(live.items())[:breakdown]:
                    print(f"  {nbytes / MiB:>8.2f} MiB  {label}")
    print(f"\n({seconds:.0f} s)")


def parse_args() -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=4, help="context-parallel degree C (processes)")
    parser.add_argument("--seq-len", type=int, default=8192, help="total sequence length S")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--n-heads", type=int, default=32)
    parser.add_argument("--n-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--stage-sizes", type=int, nargs="+", default=None,
                        help="heads per stage U to compare (default: C, 2C, H; H is always added)")
    parser.add_argument("--breakdown", type=int, default=0, metavar="N",
                        help="also print the N largest origins of live bytes at each peak")
    parser.add_argument("--json", action="store_true", help="print results as JSON instead")
    args = parser.parse_args()
    if args.seq_len % args.cp:
        parser.error(f"--seq-len {args.seq_len} must be divisible by --cp {args.cp}")
    sizes = sorted(set(args.stage_sizes or [args.cp, 2 * args.cp]) | {args.n_heads})
    cfg = Config(args.cp, args.seq_len, args.batch, args.n_heads, args.n_kv_heads,
                 args.head_dim, args.dtype, tuple(sizes))
    return cfg, args


def main() -> None:
    cfg, args = parse_args()
    check_tracker()
    start = time.perf_counter()
    rows = run(cfg)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({"config": asdict(cfg), "analytic_bytes": analytic_sizes(cfg),
                          "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print_report(cfg, rows, args.breakdown, seconds)


if __name__ == "__main__":
    main()
