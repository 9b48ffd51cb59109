"""Measure this machine as the step-time model sees a GPU: a hardware profile of CPU ranks.

Run under torchrun with the world size of the jobs it will price, so each rank measures what it
gets while the others run too (the ranks share the cores; torchrun gives each one thread):

    torchrun --nproc_per_node 2 benchmarks/cpu_profile.py --out outputs/cpu_profile_2.json

Measured (the median of repeats, then the slowest rank):
- matmul FLOP/s: float32 ``mm`` of a transformer's shapes (tokens x dim x 3 dim, tokens x 3 dim x
  dim) at the debug flavor's size;
- attention FLOP/s of the CPU flash kernel, forward causal, forward full and backward
  (FlashAttention's counting, as the model counts);
- memory bandwidth: an elementwise add of large tensors (read two, write one);
- the fixed cost of one op: a tiny elementwise op, dispatch included;
- gloo: all-to-all, all-gather / reduce-scatter (bus bytes, NCCL's convention), point-to-point,
  and the latency of a tiny all-to-all.
Host and device are one memory on CPU, so the host link is the memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from upipe_dtensor.planning.hardware import AttentionRates, HardwareProfile
from upipe_dtensor.planning.step_work import visible_pairs

SOURCE = "benchmarks/cpu_profile.py on this machine"


def _seconds(work: Callable[[], object], repeats: int = 7, barrier: bool = False) -> float:
    """Median wall time of ``work`` (after one warm-up), all ranks starting together."""
    work()
    times = []
    for _ in range(repeats):
        if barrier:
            dist.barrier()
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _matmul(tokens: int, dim: int) -> float:
    a, w1, w2 = torch.randn(tokens, dim), torch.randn(dim, 3 * dim), torch.randn(3 * dim, dim)
    flops = 2 * tokens * dim * 3 * dim * 2
    return flops / _seconds(lambda: (a @ w1) @ w2)


def _attention(batch: int, heads: int, seq: int, head_dim: int) -> AttentionRates:
    q, k, v = (torch.randn(batch, heads, seq, head_dim) for _ in range(3))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    causal_pairs, full_pairs = visible_pairs(seq, seq, True), seq * seq
    unit = 4 * batch * heads * head_dim
    out, lse = op(q, k, v, 0.0, True)
    rates = {
        "forward_causal": unit * causal_pairs / _seconds(lambda: op(q, k, v, 0.0, True)),
        "forward_full": unit * full_pairs / _seconds(lambda: op(q, k, v, 0.0, False)),
        "backward": 2.5
        * unit
        * causal_pairs
        / _seconds(lambda: backward(out, q, k, v, out, lse, 0.0, True)),
    }
    return AttentionRates(**rates, source=SOURCE)


def _memory_bandwidth(elements: int = 2**23) -> float:
    a, b = torch.randn(elements), torch.randn(elements)
    out = torch.empty_like(a)
    return 3 * a.nbytes / _seconds(lambda: torch.add(a, b, out=out))


def _op_overhead() -> float:
    x = torch.randn(8)
    return _seconds(lambda: [x.add(1.0) for _ in range(1000)]) / 1000


def _collectives(nbytes: int) -> dict[str, float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    elements = nbytes // 4 // world * world
    x = torch.randn(elements)
    out = torch.empty_like(x)
    shard = torch.empty(elements // world)
    wire = x.nbytes * (world - 1) / world  # what each rank sends (all-to-all), the bus bytes
    a2a = _seconds(lambda: dist.all_to_all_single(out, x), barrier=True)
    gather = _seconds(lambda: dist.all_gather_single(out, shard), barrier=True)
    scatter = _seconds(lambda: dist.reduce_scatter_single(shard, x), barrier=True)
    peer = rank ^ 1

    def exchange() -> None:
        if peer >= world:
            return
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, out, peer)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    p2p = _seconds(exchange, barrier=True)
    tiny, tiny_out = torch.randn(world), torch.empty(world)
    latency = _seconds(lambda: dist.all_to_all_single(tiny_out, tiny), barrier=True)
    return {
        "all_to_all_bus_bytes_per_s": wire / a2a,
        "collective_bus_bytes_per_s": 2 * wire / (gather + scatter),
        "p2p_bytes_per_s": x.nbytes / p2p,
        "collective_latency_s": latency,
    }


def measure(dim: int, tokens: int) -> HardwareProfile:
    head_dim = 32
    rates = {
        "matmul_flops": _matmul(tokens, dim),
        "memory_bytes_per_s": _memory_bandwidth(),
        "op_overhead_s": _op_overhead(),
        **_collectives(8 * 2**20),
    }
    attention = _attention(batch=4, heads=dim // head_dim // 2, seq=2 * tokens // 4, head_dim=32)
    # The slowest rank sets the pace: every rate at its minimum over ranks, every cost at its max.
    gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, {**rates, "attention": asdict(attention)})
    slowest = {key: (max if key.endswith("_s") else min)(r[key] for r in gathered) for key in rates}
    attention_rates = {
        key: min(r["attention"][key] for r in gathered)
        for key in ("forward_causal", "forward_full", "backward")
    }
    cpu = AttentionRates(**attention_rates, source=SOURCE)
    return HardwareProfile(
        name=f"cpu ({dist.get_world_size()} gloo ranks)",
        peak_flops=slowest["matmul_flops"],
        matmul_flops=slowest["matmul_flops"],
        memory_bytes_per_s=slowest["memory_bytes_per_s"],
        attention={"cpu": cpu, "flash": cpu},
        all_to_all_bus_bytes_per_s=slowest["all_to_all_bus_bytes_per_s"],
        collective_bus_bytes_per_s=slowest["collective_bus_bytes_per_s"],
        p2p_bytes_per_s=slowest["p2p_bytes_per_s"],
        inter_node_bytes_per_s=slowest["p2p_bytes_per_s"],
        collective_latency_s=slowest["collective_latency_s"],
        host_link_bytes_per_s=slowest["memory_bytes_per_s"],
        host_adamw_params_per_s=slowest["memory_bytes_per_s"] / 28,
        op_overhead_s=slowest["op_overhead_s"],
        sources={"all": SOURCE, "peak_flops": "the measured matmul rate (MFU on CPU is vs it)"},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dim", type=int, default=256, help="the model width (debug flavor)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        profile = measure(args.dim, args.tokens)
        if dist.get_rank() == 0:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(profile.as_dict(), indent=1))
            print(json.dumps(profile.as_dict()))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
