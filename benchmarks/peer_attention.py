"""One Llama3 attention layer under DeepSpeed's and yunchang's Ulysses beside this project's
styles: outputs, gradients, peak memory and time, side by side in one run on CPU + gloo.

The layer is the attention of this project's Llama3 (``models.family``'s ``llama3``: torchtitan's
attention module of the installed generation, 0.2.2's ``Attention`` or 0.3.0's ``GQAttention``,
with ``wq``, ``wk``, ``wv``, ``wo`` and RoPE frequencies), the same weights in every row. The
peers' rows compute with that module's projections and RoPE, read through its attention adapter
(the same code on both generations, as torchtitan's forward computes them), and put the peer's
Ulysses in place of its local attention (``inner_attention``), with torch SDPA inside (causal,
GQA by ``enable_gqa``), as a user of that peer runs it:

* **DeepSpeed**: ``deepspeed.sequence.layer.DistributedAttention(sdpa, group, scatter_idx=2,
  gather_idx=1)``, the ALST seed's Ulysses. Its collectives go through ``deepspeed.comm``, whose
  backend ``deepspeed.init_distributed`` creates; on a CPU machine that also JIT-builds a
  shared-memory all-reduce op (``ShareMemCommBuilder``: minutes of C++ compilation) that this
  layer never calls. The benchmark initialises torch.distributed itself and hands
  ``deepspeed.comm`` the ``TorchBackend`` that ``init_distributed`` would, built with that op
  left out (``deepspeed.comm.torch.build_shm_op`` answering None, as it does where the op cannot
  be built): every all-to-all is then ``torch.distributed.all_to_all_single`` on the gloo group,
  as with the op.
* **yunchang**: ``yunchang.UlyssesAttention(group, scatter_idx=2, gather_idx=1)``, the UPipe
  paper's baseline code path, its ``attn_fn`` set to the same torch SDPA (yunchang's own torch
  kernels run its ring code, its flash-attn kernels need CUDA).

This project's rows apply each registered style to the same module with ``parallelize_module``
and call it with the arguments its block passes (``block_arguments``), at the style's defaults
(UPipe: U = C, stages in turn), plus UPipe with overlapped stages and at U = 2C.

Per row, on C gloo ranks (the peers on contiguous shards, each style on its own layout; outputs
compared at the same global positions):

* **diff**: the largest difference of y, dx and every weight gradient (summed over ranks) from
  DeepSpeed's, with trainable weights; and of dx with frozen ones;
* **peak**: the bytes the layer adds above what was live before its forward, over its forward
  and backward in one window, max over ranks: every thread's allocations and frees, from an
  allocation trace (``alloc_trace``: the ranks run with it in ``LD_PRELOAD``), since gloo's
  worker threads free all-to-all buffers that the profiler's allocator events never see free
  (``peer_accounting.py`` compares the measures). **plain**: autograd keeps what the layer saves;
  **ckpt**: the layer under ``torch.utils.checkpoint`` (non-reentrant), as every long-context
  recipe runs its blocks. **trainable** weights: the window ends holding dwq, dwk, dwv and dwo;
  **frozen** (``requires_grad_(False)``): activation memory alone, what grows with the context
  (LoRA, frozen layers). The floor column is what every row's window must hold at its end: y,
  dx and, trainable, the weight gradients;
* **time**: wall seconds of one forward and backward (plain, trainable), the median of the
  ranks': CPU time, for comparing the rows of one run, not a GPU time.

Run: ``python benchmarks/peer_attention.py`` (C = 4, float32, the four geometries of
docs/memory-stack.md: MHA 32/32 heads of 16 at S = 16K, GQA 32/8 heads of 64 and of 128,
Llama3-8B's, at S = 8K, and GQA 32/8 heads of 16 at S = 16K, where a rank's tokens outnumber the
width 8 to 1 as at long context; about 50 minutes on 2 cores); ``--geometry H/KV/d/S``
(repeatable) for others, ``--rows`` to pick rows, ``--modes`` to measure only some of the four
modes (e.g. ``--rows deepspeed "ours: Ulysses" --modes plain "plain frozen"``, one cell in
minutes where the whole table takes an hour), ``--json`` for machine output, ``--table
JSON`` to print the tables of a stored report (``benchmarks/results/peer_attention.json``, the
docs' tables). The peers come with ``pip install -e ".[peers]"``; one that is not installed is
skipped with one line.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from alloc_trace import peak, preloaded, traced
from live_memory import MiB, on_gloo_ranks
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.checkpoint import checkpoint

from upipe_dtensor.kernels.rope import rope_table
from upipe_dtensor.models import get_family, init_sharded_weights
from upipe_dtensor.parallel import registry
from upipe_dtensor.parallel.attention_interface import attention_adapter
from upipe_dtensor.runtime.parity import cast_parameters

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODES = {  # name -> (checkpointed, frozen weights)
    "plain": (False, False),
    "ckpt": (True, False),
    "plain frozen": (False, True),
    "ckpt frozen": (True, True),
}


@dataclass(frozen=True)
class Geometry:
    """Query heads, KV heads, head dim and sequence length of one layer (dim = heads * d)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    seq_len: int

    @classmethod
    def parse(cls, text: str) -> Geometry:
        """From ``H/KV/d/S``, S in tokens or with a K suffix (16K = 16384)."""
        try:
            h, kv, d, s = text.split("/")
            seq = int(s[:-1]) * 1024 if s.upper().endswith("K") else int(s)
            return cls(int(h), int(kv), int(d), seq)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--geometry {text!r}: give heads/kv_heads/head_dim/seq_len, e.g. 32/8/128/8K"
            ) from None

    @property
    def dim(self) -> int:
        return self.n_heads * self.head_dim

    def __str__(self) -> str:
        return f"H {self.n_heads} / KV {self.n_kv_heads}, d {self.head_dim}, S {self.seq_len:,}"


DEFAULT_GEOMETRIES = (
    Geometry(32, 32, 16, 16384),  # MHA, small heads: N = 8 D tokens per rank
    Geometry(32, 8, 64, 8192),
    Geometry(32, 8, 128, 8192),  # Llama3-8B's heads
    Geometry(32, 8, 16, 16384),  # GQA at N = 8 D: the weights' gradients small beside activations
)


@dataclass(frozen=True)
class Row:
    """A peer's Ulysses (``peer``) or one of this project's styles (``style`` and options)."""

    name: str
    peer: str = ""
    style: str = ""
    options: tuple[tuple[str, Any], ...] = ()


PEER_ROWS = (Row("DeepSpeed Ulysses", peer="deepspeed"), Row("yunchang Ulysses", peer="yunchang"))


def project_rows(cp: int, seq_len: int) -> tuple[Row, ...]:
    """Every registered style at its defaults; UPipe also overlapped and at U = 2C; the FPDT
    rows in 4 sequence chunks."""
    chunk = ("chunk_tokens", seq_len // 4)
    return (
        Row("ours: Ulysses", style="ulysses"),
        Row("ours: UPipe, U = C", style="upipe"),
        Row("ours: UPipe, U = C, overlapped", style="upipe", options=(("overlap_stages", True),)),
        Row("ours: UPipe, U = 2C", style="upipe", options=(("heads_per_stage", 2 * cp),)),
        Row("ours: ring", style="ring"),
        Row("ours: FPDT, 4 chunks", style="fpdt", options=(chunk,)),
        Row("ours: UPipe x FPDT, 4 chunks", style="upipe", options=(chunk,)),
    )


# --- the peers ---------------------------------------------------------------------------------


def local_sdpa(q: Tensor, k: Tensor, v: Tensor, *_, **__) -> Tensor:
    """Causal torch SDPA on (B, S, heads, d), GQA by ``enable_gqa``: both peers' local attention."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=True,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def rotate(x: Tensor, table: Tensor) -> Tensor:
    """RoPE of (B, S, heads, d) ``x`` by a (S, d/2, 2) table of (cos, sin), interleaved pairs, as
    torchtitan's Llama3 applies it (a complex product, in float32)."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * torch.view_as_complex(table)[:, None]).flatten(3).type_as(x)


class PeerAttention(nn.Module):
    """This project's attention module with a peer's Ulysses as its local attention: the
    module's own ``wq``, ``wk``, ``wv``, ``wo`` and RoPE frequencies, read through its adapter
    (``parallel.attention_interface``), which gives them on either torchtitan generation, and
    computed as torchtitan's forward does; the peer takes and returns (B, S/C, heads, d)."""

    def __init__(
        self,
        attention: nn.Module,
        ulysses: Callable[[Tensor, Tensor, Tensor], Tensor],
        frequencies: Tensor,
    ) -> None:
        super().__init__()
        self.attention, self.ulysses, self.frequencies = attention, ulysses, frequencies
        self.head_dim = attention_adapter(attention).layer(attention).head_dim

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        weights = attention_adapter(self.attention).weights(self.attention)
        table = rope_table(self.frequencies, positions)
        q, k, v = (F.linear(x, w).unflatten(-1, (-1, self.head_dim)) for w in weights.qkv)
        out = self.ulysses(rotate(q, table), rotate(k, table), v)
        return F.linear(out.flatten(2), weights.wo)


PEER_MODULES = {"deepspeed": "deepspeed.sequence.layer", "yunchang": "yunchang"}
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's accelerator, named: no detection


def missing_peer(peer: str) -> str:
    """Why ``peer`` does not import ("" when it does)."""
    try:
        importlib.import_module(PEER_MODULES[peer])
    except Exception as err:  # a peer's import fails in many ways; each means: skip it
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return ""


def _deepspeed_comm_without_shm_op() -> None:
    """``deepspeed.comm``'s backend on the process group torch.distributed holds, without
    JIT-building the CPU shared-memory all-reduce op (module docstring)."""
    ds_comm = importlib.import_module("deepspeed.comm.comm")
    ds_torch = importlib.import_module("deepspeed.comm.torch")  # not the attribute: torch itself
    if ds_comm.cdb is None:
        build, ds_torch.build_shm_op = ds_torch.build_shm_op, lambda: None
        try:
            ds_comm.cdb = ds_torch.TorchBackend("gloo", ds_comm.default_pg_timeout, None)
        finally:
            ds_torch.build_shm_op = build


def peer_ulysses(peer: str, group: dist.ProcessGroup) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The peer's Ulysses over ``group``, (B, S/C, heads, d) q, k, v -> the output."""
    if peer == "deepspeed":
        from deepspeed.sequence.layer import DistributedAttention

        _deepspeed_comm_without_shm_op()
        attention = DistributedAttention(local_sdpa, group, scatter_idx=2, gather_idx=1)
        return lambda q, k, v: attention(q, k, v, batch_dim_idx=0)
    from yunchang import UlyssesAttention as YunchangUlysses
    from yunchang.kernels import AttnType

    # TORCH_FLASH constructs without flash-attn; its kernel is replaced by the same SDPA.
    attention = YunchangUlysses(group, scatter_idx=2, gather_idx=1, attn_type=AttnType.TORCH_FLASH)
    attention.attn_fn = local_sdpa
    return lambda q, k, v: attention(q, k, v, causal=True)


# --- one row -----------------------------------------------------------------------------------


def build_attention(
    geometry: Geometry, dtype: torch.dtype
) -> tuple[nn.Module, Tensor, tuple, dict[str, Any]]:
    """The attention layer of a one-block Llama3 of this project's ``llama3`` family (its model
    class on the installed torchtitan generation, an FFN of 64 to keep it small) with
    torchtitan's initial weights, the same on every rank and in every row; its RoPE frequencies
    (``rope_frequencies``); and the arguments after ``x`` its block passes it
    (``block_arguments``: each layer derives its RoPE rows from the frequencies; no mask, no
    positions)."""
    family = get_family("llama3")
    args = family.args_class(
        dim=geometry.dim,
        n_layers=1,
        n_heads=geometry.n_heads,
        n_kv_heads=geometry.n_kv_heads,
        ffn_dim=64,
        vocab_size=64,
        rope_theta=500000.0,
        max_seq_len=geometry.seq_len,
    )
    model = family.model_class(args)
    init_sharded_weights(model, seed=0, device=torch.device("cpu"))
    attention = model.layers["0"].attention
    cast_parameters(attention, dtype)
    call_args, call_kwargs = model.block_arguments(None, None, None)
    return attention, model.rope_frequencies(), call_args, call_kwargs


@dataclass
class Layer:
    """One row's layer on this rank: the module called, the attention module whose parameters it
    computes with, the global positions of its shard, and the arguments after ``x``: the peers'
    module takes its positions (contiguous shards, as torchtitan's CP passes them), the styles
    what the block passes (they place their shard by their own layout). Each computes its
    shard's RoPE rows from the frequencies inside its forward, so each row's window holds them."""

    module: nn.Module
    attention: nn.Module
    positions: Tensor
    args: tuple
    kwargs: dict[str, Any]

    def __call__(self, x: Tensor, checkpointed: bool) -> Tensor:
        peer = isinstance(self.module, PeerAttention)
        args = (self.positions[: x.shape[1]],) if peer else self.args
        if checkpointed:
            return checkpoint(self.module, x, *args, use_reentrant=False, **self.kwargs)
        return self.module(x, *args, **self.kwargs)


def make_layer(row: Row, geometry: Geometry, dtype: torch.dtype, mesh: DeviceMesh) -> Layer:
    rank, cp = mesh.get_local_rank(), mesh.size()
    attention, frequencies, args, kwargs = build_attention(geometry, dtype)
    if row.peer:
        ulysses = peer_ulysses(row.peer, mesh.get_group())
        local = geometry.seq_len // cp
        positions = torch.arange(rank * local, (rank + 1) * local)
        return Layer(PeerAttention(attention, ulysses, frequencies), attention, positions, (), {})
    style = registry.make_style({"cp_style": row.style, **dict(row.options)})
    attention = parallelize_module(attention, mesh, style)
    positions = style.shard_positions(geometry.seq_len, rank, cp)
    return Layer(attention, attention, positions, args, kwargs)


def _set_frozen(module: nn.Module, frozen: bool) -> None:
    for p in module.parameters():
        p.requires_grad_(not frozen)


def settle() -> None:
    """Before a window: collect the earlier rows' garbage (reference cycles hold their layers and
    buffers until Python's collector runs, which could be inside a window, whose frees of them
    would then lower the layer's peak), then wait for every rank."""
    gc.collect()
    dist.barrier()


def _peak(layer: Layer, x_shard: Tensor, grad: Tensor, checkpointed: bool) -> tuple[int, Tensor]:
    """(the window's peak bytes, dx) of one forward and backward: every thread's allocations and
    frees (``alloc_trace``: gloo's worker threads free all-to-all buffers)."""
    x = x_shard.clone().requires_grad_()
    settle()
    with traced() as trace:
        y = layer(x, checkpointed)
        y.backward(grad)
    return peak(trace.records), x.grad


def prepare(
    row: Row, geometry: Geometry, dtype: torch.dtype, mesh: DeviceMesh
) -> tuple[Layer, Tensor, Tensor]:
    """One row's layer on this rank, run once on 64 tokens (lazy one-offs), with this rank's
    shard of the input and of the output gradient (the same global ones in every row)."""
    layer = make_layer(row, geometry, dtype, mesh)
    generator = torch.Generator().manual_seed(1)
    x_all = torch.randn(1, geometry.seq_len, geometry.dim, generator=generator, dtype=dtype)
    grad_all = torch.randn(1, geometry.seq_len, geometry.dim, generator=generator, dtype=dtype)
    x_shard = x_all[:, layer.positions].contiguous()
    grad = grad_all[:, layer.positions].contiguous()
    del x_all, grad_all
    layer(x_shard[:, :64].clone().requires_grad_(), False).sum().backward()
    layer.module.zero_grad(set_to_none=True)
    return layer, x_shard, grad


def measure(
    row: Row,
    geometry: Geometry,
    dtype: torch.dtype,
    mesh: DeviceMesh,
    modes: Sequence[str] = tuple(MODES),
) -> dict:
    """This rank's numbers of one row: the time and outputs of a plain trainable call, then
    the peak of each of ``modes`` (in ``MODES``' order)."""
    layer, x_shard, grad = prepare(row, geometry, dtype, mesh)
    x = x_shard.clone().requires_grad_()
    dist.barrier()
    start = time.perf_counter()
    y = layer(x, False)
    y.backward(grad)
    seconds = time.perf_counter() - start
    outputs = {"y": y.detach(), "dx": x.grad}
    outputs.update({name: p.grad for name, p in layer.attention.named_parameters()})
    del y, x
    layer.module.zero_grad(set_to_none=True)
    peaks = {}
    for mode, (checkpointed, frozen) in MODES.items():
        if mode not in modes:
            continue
        _set_frozen(layer.module, frozen)
        peaks[mode], dx = _peak(layer, x_shard, grad, checkpointed)
        if mode == "plain frozen":
            outputs["dx frozen"] = dx
        layer.module.zero_grad(set_to_none=True)
    _set_frozen(layer.module, False)
    return {"peaks": peaks, "seconds": seconds, "outputs": outputs, "positions": layer.positions}


def _global(values: Tensor, positions: Tensor, seq_len: int) -> Tensor:
    """(1, S, ...) from every rank's (1, S/C, ...) shard at its global ``positions``."""
    world = dist.get_world_size()
    shards = [torch.empty_like(values) for _ in range(world)]
    where = [torch.empty_like(positions) for _ in range(world)]
    dist.all_gather(shards, values.contiguous())
    dist.all_gather(where, positions)
    whole = values.new_empty(1, seq_len, *values.shape[2:])
    for shard, index in zip(shards, where):
        whole[:, index] = shard
    return whole


def differences(mine: dict, reference: dict, seq_len: int) -> dict[str, float]:
    """The largest absolute difference from the reference row: trainable (y, dx, each weight
    gradient summed over ranks) and frozen (dx)."""
    worst = {"trainable": 0.0, "frozen": 0.0}
    for name, value in mine["outputs"].items():
        ref = reference["outputs"][name]
        if name in ("y", "dx", "dx frozen"):
            value = _global(value, mine["positions"], seq_len)
            ref = _global(ref, reference["positions"], seq_len)
        else:
            value, ref = value.clone(), ref.clone()
            dist.all_reduce(value)
            dist.all_reduce(ref)
        kind = "frozen" if name == "dx frozen" else "trainable"
        worst[kind] = max(worst[kind], (value.float() - ref.float()).abs().max().item())
    return worst


def floors(geometry: Geometry, cp: int, dtype: torch.dtype) -> dict[str, int]:
    """What every row's window holds at its end, per rank: y and dx, and with trainable weights
    dwq, dwk, dwv and dwo (bytes)."""
    item = dtype.itemsize
    activation = geometry.seq_len // cp * geometry.dim * item
    kv_dim = geometry.n_kv_heads * geometry.head_dim
    weights = (2 * geometry.dim * geometry.dim + 2 * kv_dim * geometry.dim) * item
    return {"trainable": 2 * activation + weights, "frozen": 2 * activation}


def _rank_rows(
    rank: int, geometry: Geometry, dtype_name: str, rows: list[dict], modes: Sequence[str]
) -> list[dict]:
    """One rank: every row in turn (the ranks stay in step through the collectives)."""
    dtype = DTYPES[dtype_name]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    reports, reference = [], None
    for spec in rows:
        row = Row(spec["name"], spec["peer"], spec["style"], tuple(map(tuple, spec["options"])))
        mine = measure(row, geometry, dtype, mesh, modes)
        reference = reference or mine
        diff = differences(mine, reference, geometry.seq_len)
        if mine is not reference:
            mine["outputs"] = None  # only the reference row's are kept
        peaks = torch.tensor(list(mine["peaks"].values()))
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        seconds: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seconds, mine["seconds"])
        reports.append(
            {
                "row": asdict(row),
                "peaks": dict(zip(mine["peaks"], peaks.tolist())),
                "seconds": statistics.median(seconds),
                "max_difference": diff,
            }
        )
    return reports


def run(
    geometry: Geometry,
    rows: list[Row],
    cp: int,
    dtype: str,
    modes: Sequence[str] = tuple(MODES),
) -> list[dict]:
    """Rank 0's reports of every row (the peaks of ``modes``), on ``cp`` gloo processes; the
    first row is the reference the differences are measured from."""
    with preloaded():
        return on_gloo_ranks(
            cp, _rank_rows, geometry, dtype, [asdict(r) for r in rows], list(modes)
        )


# --- reporting ---------------------------------------------------------------------------------


def markdown_table(reports: list[dict], floor: dict[str, int]) -> str:
    """MiB per mode with the ratio to the first row (DeepSpeed's Ulysses when installed), and the
    floor every row's window ends with."""
    reference = reports[0]
    ref_name = reference["row"]["name"]
    modes = list(reference["peaks"])  # the modes measured (``--modes``)
    lines = [
        f"| row | {' | '.join(modes)} | time (s) | max diff vs {ref_name} |",
        "|---|" + "---:|" * (len(modes) + 2),
    ]
    for r in reports:
        cells = []
        for mode in modes:
            mib = r["peaks"][mode] / MiB
            ratio = r["peaks"][mode] / reference["peaks"][mode]
            cells.append(f"{mib:.1f}" if r is reference else f"{mib:.1f} ({ratio:.2f}x)")
        diff = r["max_difference"]
        lines.append(
            f"| {r['row']['name']} | {' | '.join(cells)} | {r['seconds']:.2f} | "
            f"{diff['trainable']:.1e} / {diff['frozen']:.1e} |"
        )
    floor_cells = [
        f"{floor['frozen' if 'frozen' in mode else 'trainable'] / MiB:.1f}" for mode in modes
    ]
    lines.append(f"| floor: y, dx (and weight grads) | {' | '.join(floor_cells)} | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=4, help="context-parallel degree (processes)")
    parser.add_argument(
        "--geometry",
        type=Geometry.parse,
        action="append",
        help="H/KV/d/S, e.g. 32/8/128/8K (repeatable; default: the three of the docs)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument(
        "--rows", nargs="+", help="only these rows (names as printed, or deepspeed, yunchang)"
    )
    parser.add_argument(
        "--modes", nargs="+", choices=list(MODES), default=list(MODES), help="only these modes"
    )
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")
    parser.add_argument(
        "--table", metavar="JSON", help="print the tables of a stored --json report (no run)"
    )
    args = parser.parse_args()
    if args.table:
        with open(args.table) as stored:
            print_tables(json.load(stored))
        return
    peers = []
    for row in PEER_ROWS:
        reason = missing_peer(row.peer)
        if reason:
            print(f"{row.name}: skipped, not installed ({reason}); pip install -e '.[peers]'")
        else:
            peers.append(row)
    results = []
    for geometry in args.geometry or DEFAULT_GEOMETRIES:
        if geometry.seq_len % args.cp:
            sys.exit(f"S = {geometry.seq_len} is not divisible by --cp {args.cp}")
        rows = peers + list(project_rows(args.cp, geometry.seq_len))
        if args.rows:
            rows = [r for r in rows if r.name in args.rows or r.peer in args.rows]
        start = time.perf_counter()
        reports = run(geometry, rows, args.cp, args.dtype, args.modes)
        floor = floors(geometry, args.cp, DTYPES[args.dtype])
        results.append(
            {
                "geometry": asdict(geometry),
                "cp": args.cp,
                "dtype": args.dtype,
                "seconds": round(time.perf_counter() - start),
                "floor": floor,
                "rows": reports,
            }
        )
        if not args.json:
            print_tables(results[-1:])
    if args.json:
        print(json.dumps(results, indent=2))


def print_tables(results: list[dict]) -> None:
    """Per geometry: a heading line, then ``markdown_table``."""
    for result in results:
        geometry = Geometry(**result["geometry"])
        print(
            f"\n{geometry}, C = {result['cp']} gloo ranks, {result['dtype']}: MiB above the level "
            "before the forward, forward and backward in one window, max over ranks"
            + (f" ({result['seconds']} s)" if "seconds" in result else "")
            + "\n"
        )
        print(markdown_table(result["rows"], result["floor"]))


if __name__ == "__main__":
    main()
