"""The kernels of a recipe's step, timed alone at the step's shapes, beside the ranges the
step-time model assumes for them (``planning.hardware``).

    python -m upipe_dtensor.gpu_check --rates --config recipes/llama3_8b_128K.toml

What is timed, for one rank of the recipe (T = local batch x seq_len / cp tokens):

- the GEMMs of one block at T tokens, each forward and its two backward products (grad input,
  grad weight): one UPipe stage's query projection and one KV block's key (= value) projection
  (the stage plan of ``parallel.head_schedule``), the output projection, one MLP tile's
  gate/up and down projections and one loss chunk against the vocabulary (the recipe's tile and
  chunk sizes);
- attention forward and backward of one head stage over the whole sequence (the stage's query
  and KV heads per rank, causal), with every backend that passes the kernel probe here, through
  the ``kernels.attention`` calls the styles make; ring, 2D and FPDT split this into blocks that
  are not timed apart;
- memory-bound ops: a copy and an add of a (T, dim) and a (T, hidden) activation;
- host transfers (CUDA): one block input (T, dim) to pinned host memory and back.

Each rate is the median of repeated runs after a warm-up (CUDA events on a GPU), in the model's
counting (FLOPs: 2 m k n per GEMM, FlashAttention's 4 x visible pairs x heads x head_dim forward
and 2.5 x that backward; bytes: read plus written), and is printed with the profile's range for
that constant and where it falls: inside, below or above. On CPU there are no ranges (the CPU
profile is measured, ``benchmarks/cpu_profile.py``): the rates are printed alone.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from upipe_dtensor.config import JobConfig, parse_args
from upipe_dtensor.kernels.attention import attention_backward, attention_forward
from upipe_dtensor.kernels.backends import BACKENDS, choose_backend
from upipe_dtensor.kernels.flash_registry import activate_backend
from upipe_dtensor.models.hf_config import model_args
from upipe_dtensor.parallel.head_schedule import make_head_schedule
from upipe_dtensor.planning.hardware import GPU_PROFILES, HardwareProfile
from upipe_dtensor.planning.step_work import visible_pairs
from upipe_dtensor.train.build import configure_allocator

REPEATS, MIN_SECONDS = 5, 0.05
"""Timed runs per kernel (at least), and the least time they add up to."""


@dataclass
class Rate:
    """One timed kernel: its rate in the model's unit, and the profile's range for it."""

    kind: str
    """"matmul", "attention forward", "attention backward", "memory-bound", "host transfers"."""
    what: str
    shape: str
    seconds: float
    rate: float
    unit: str
    low: float | None = None
    high: float | None = None
    constant: str = ""

    @property
    def verdict(self) -> str:
        return verdict(self.rate, self.low, self.high)


def verdict(rate: float, low: float | None, high: float | None) -> str:
    """Where a measured rate falls against a range: inside, below or above (n/a: no range)."""
    if low is None or high is None:
        return "n/a"
    return "below" if rate < low else "above" if rate > high else "inside"


def profile_range(
    profile: HardwareProfile | None, constant: str
) -> tuple[float | None, float | None]:
    """A profile constant's (low, high) (``hardware.Range``; None, None when it has none)."""
    if profile is None or constant not in profile.ranges:
        return None, None
    ranged = profile.ranges[constant]
    return ranged.low, ranged.high


def gpu_profile(device: torch.device) -> HardwareProfile | None:
    """The step-time model's profile of this GPU (None on CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return GPU_PROFILES["h200" if "H200" in name else "h100-sxm"]


def seconds_per_call(run: Callable[[], object], device: torch.device) -> float:
    """Median seconds of ``run`` after a warm-up: at least ``REPEATS`` runs and ``MIN_SECONDS``."""
    run()
    times: list[float] = []
    while len(times) < REPEATS or sum(times) < MIN_SECONDS:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            run()
            times.append(time.perf_counter() - began)
        if len(times) >= 100:
            break
    return statistics.median(times)


@dataclass(frozen=True)
class StepShapes:
    """The shapes of one rank's step that the rates are timed at."""

    tokens: int
    dim: int
    hidden: int
    vocab: int
    head_dim: int
    seq_len: int
    stage_query_heads: int
    """Query heads per rank in one head stage (after the all-to-all)."""
    stage_kv_heads: int
    query_projection_heads: int
    """Query heads one stage projects from the local shard (U)."""
    kv_projection_heads: int
    """KV heads one KV block projects (each of K and V)."""
    mlp_tile: int
    loss_chunk: int

    @classmethod
    def of(cls, config: JobConfig) -> StepShapes:
        training, parallelism, memory = config.training, config.parallelism, config.memory
        args = model_args(config.model, training.seq_len)
        n_heads, n_kv = args.n_heads, args.n_kv_heads or args.n_heads
        cp = parallelism.context_parallel_degree
        schedule = make_head_schedule(
            n_heads, n_kv, parallelism.head_degree, parallelism.stage_heads(n_heads)
        )
        start, stop = schedule.kv_block_heads(0)
        tokens = training.local_batch_size * training.seq_len // cp
        return cls(
            tokens=tokens,
            dim=args.dim,
            hidden=args.resolved_ffn_dim,
            vocab=args.vocab_size,
            head_dim=args.resolved_head_dim,
            seq_len=training.seq_len // parallelism.ring_degree,
            stage_query_heads=schedule.query_heads_per_rank,
            stage_kv_heads=schedule.kv_heads_per_rank,
            query_projection_heads=schedule.heads_per_stage,
            kv_projection_heads=stop - start,
            mlp_tile=min(tokens, memory.mlp_tile_tokens or args.dim)
            if memory.tiled_mlp
            else tokens,
            loss_chunk=min(tokens, memory.loss_chunk_tokens) if memory.chunked_loss else tokens,
        )


def _gemm_rates(shapes: StepShapes, device, dtype, profile) -> list[Rate]:
    d, hd = shapes.dim, shapes.head_dim
    gemms = {  # name: (m, k, n) of the forward product
        "query projection, one stage": (shapes.tokens, d, shapes.query_projection_heads * hd),
        "key projection, one KV block": (shapes.tokens, d, shapes.kv_projection_heads * hd),
        "output projection": (shapes.tokens, d, d),
        "MLP gate/up, one tile": (shapes.mlp_tile, d, shapes.hidden),
        "MLP down, one tile": (shapes.mlp_tile, shapes.hidden, d),
        "loss, one chunk": (shapes.loss_chunk, d, shapes.vocab),
    }
    low, high = profile_range(profile, "matmul_flops")
    rates = []
    for name, (m, k, n) in gemms.items():
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(k, n, device=device, dtype=dtype)
        dy = torch.randn(m, n, device=device, dtype=dtype)
        products = {
            "forward": lambda x=x, w=w: x @ w,
            "grad input": lambda dy=dy, w=w: dy @ w.t(),
            "grad weight": lambda x=x, dy=dy: x.t() @ dy,
        }
        for pass_name, run in products.items():
            seconds = seconds_per_call(run, device)
            rates.append(
                Rate(
                    "matmul",
                    f"{name}, {pass_name}",
                    f"{m}x{k}x{n}",
                    seconds,
                    2 * m * k * n / seconds,
                    "FLOP/s",
                    low,
                    high,
                    "matmul_flops",
                )  # fmt: skip
            )
        del x, w, dy
    return rates


def attention_backends(device: torch.device, shapes: StepShapes, dtype) -> tuple[list[str], dict]:
    """The backends that pass the probe here at the model's head_dim (CPU: its one kernel)."""
    if device.type != "cuda":
        return ["cpu"], {}
    working, skipped = [], {}
    for name in BACKENDS:
        if name == "auto":
            continue
        try:
            choose_backend(name, "cuda", head_dim=shapes.head_dim, dtype=dtype)
            working.append(name)
        except ValueError as err:
            skipped[name] = str(err)
    return working, skipped


def _attention_rates(shapes: StepShapes, device, dtype, profile, kernels: list[str]) -> list[Rate]:
    s, hq, hk, hd = shapes.seq_len, shapes.stage_query_heads, shapes.stage_kv_heads, shapes.head_dim
    generator = torch.Generator().manual_seed(0)

    def draw(heads: int) -> torch.Tensor:
        return torch.randn(1, s, heads, hd, generator=generator).to(device, dtype)

    q, k, v, grad = draw(hq), draw(hk), draw(hk), draw(hq)
    scale = hd**-0.5
    forward_flops = 4 * visible_pairs(s, s, True) * hq * hd
    rates = []
    for kernel in kernels:
        if device.type == "cuda":
            activate_backend(kernel)
        out, lse = attention_forward(q, k, v, scale, kernel)
        runs = {
            "forward": (functools.partial(attention_forward, q, k, v, scale, kernel), 1.0),
            "backward": (
                functools.partial(attention_backward, grad, q, k, v, out, lse, scale, kernel),
                2.5,
            ),
        }
        for direction, (run, factor) in runs.items():
            constant = (
                f"attention.{kernel}.{'forward_causal' if direction == 'forward' else 'backward'}"
            )
            low, high = profile_range(profile, constant)
            seconds = seconds_per_call(run, device)
            rates.append(
                Rate(
                    f"attention {direction}",
                    f"{kernel}, causal",
                    f"S={s} hq={hq} hkv={hk} d={hd}",
                    seconds,
                    factor * forward_flops / seconds,
                    "FLOP/s",
                    low,
                    high,
                    constant,
                )  # fmt: skip
            )
    return rates


def _memory_rates(shapes: StepShapes, device, dtype, profile) -> list[Rate]:
    low, high = profile_range(profile, "memory_bytes_per_s")
    rates = []
    for width, name in ((shapes.dim, "dim"), (shapes.hidden, "hidden")):
        a = torch.randn(shapes.tokens, width, device=device, dtype=dtype)
        b, out = torch.randn_like(a), torch.empty_like(a)
        for what, run, moved in (
            ("copy", lambda a=a, out=out: out.copy_(a), 2),
            ("add", lambda a=a, b=b, out=out: torch.add(a, b, out=out), 3),
        ):
            seconds = seconds_per_call(run, device)
            rates.append(
                Rate(
                    "memory-bound",
                    f"{what}, (tokens, {name})",
                    f"{shapes.tokens}x{width}",
                    seconds,
                    moved * a.nbytes / seconds,
                    "B/s",
                    low,
                    high,
                    "memory_bytes_per_s",
                )  # fmt: skip
            )
    return rates


def _host_rates(shapes: StepShapes, device, dtype, profile) -> list[Rate]:
    if device.type != "cuda":
        return []
    low, high = profile_range(profile, "host_link_bytes_per_s")
    block = torch.randn(shapes.tokens, shapes.dim, device=device, dtype=dtype)
    host = torch.empty(block.shape, dtype=dtype, pin_memory=True)
    rates = []
    for what, run in (
        ("to host (pinned)", lambda: host.copy_(block, non_blocking=True)),
        ("to device (pinned)", lambda: block.copy_(host, non_blocking=True)),
    ):
        seconds = seconds_per_call(run, device)
        rates.append(
            Rate(
                "host transfers",
                f"one block input {what}",
                f"{shapes.tokens}x{shapes.dim}",
                seconds,
                block.nbytes / seconds,
                "B/s",
                low,
                high,
                "host_link_bytes_per_s",
            )  # fmt: skip
        )
    return rates


def measure(config: JobConfig, device: torch.device) -> dict:
    """Every rate of the module docstring, as the report's dict."""
    shapes = StepShapes.of(config)
    profile = gpu_profile(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernels, skipped = attention_backends(device, shapes, dtype)
    rates = _gemm_rates(shapes, device, dtype, profile)
    rates += _attention_rates(shapes, device, dtype, profile, kernels)
    rates += _memory_rates(shapes, device, dtype, profile)
    rates += _host_rates(shapes, device, dtype, profile)
    return {
        "config_file": config.config_file,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "profile": profile.name if profile else None,
        "shapes": asdict(shapes),
        "skipped_backends": skipped,
        "rates": [asdict(rate) | {"verdict": rate.verdict} for rate in rates],
    }


def scaled(value: float | None, unit: str) -> str:
    """A rate in words: T(era) or G(iga) of its unit ("-" for none)."""
    if value is None:
        return "-"
    return f"{value / 1e12:.0f}T" if value >= 1e12 else f"{value / 1e9:.1f}G"


def render(result: dict) -> list[str]:
    lines = [
        f"kernel rates at the step's shapes: {result['config_file']}, {result['device']}, torch "
        f"{result['torch']}, ranges of {result['profile'] or 'no profile (CPU)'}",
        f"  {'kind':<18s} {'what':<44s} {'shape':<28s} {'ms':>8s} {'rate':>8s} "
        f"{'range':>13s} verdict",
    ]
    for r in result["rates"]:
        span = f"{scaled(r['low'], r['unit'])}-{scaled(r['high'], r['unit'])}"
        lines.append(
            f"  {r['kind']:<18s} {r['what']:<44s} {r['shape']:<28s} {r['seconds'] * 1e3:8.3f} "
            f"{scaled(r['rate'], r['unit']):>8s} {span:>13s} {r['verdict']}"
        )
    lines += [f"  (skipped) {name}: {why}" for name, why in result["skipped_backends"].items()]
    return lines


def run(argv: list[str], device_type: str, json_path: str | None = None) -> dict:
    """Time the rates of the recipe ``argv`` names on this device; print and return them."""
    config = parse_args(argv)
    configure_allocator(config)
    device = torch.device(device_type, torch.cuda.current_device() if device_type == "cuda" else 0)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    result = measure(config, device)
    print("\n".join(render(result)), flush=True)  # the command's output: the rates table
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
    return result
