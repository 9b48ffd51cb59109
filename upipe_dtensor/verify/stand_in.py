"""One device stands in for one rank: rank 0 of a recipe's world, measured, beside its plan.

    python -m upipe_dtensor.gpu_check --stand-in --config recipes/llama3_8b_128K.toml
    python -m upipe_dtensor.gpu_check --stand-in --device cpu \
        --config train_configs/debug_model.toml --parallelism.context_parallel_degree 4

One process runs rank 0 of the recipe's world (FSDP, CP and DP as configured, the world size the
recipe asks for) on this one device under a fake process group (``runtime.fake_process_group``),
with real tensors, the real caching allocator, the real kernels and the compiled blocks: a
warm-up step (it compiles), timed steps, and one profiled step. It prints, beside the planner's
plan of the same job with the attention backend that really ran, the measured peak memory and
step time. torchtitan ships the same idea as its dry run (``[comm] mode = "fake_backend"``).

What the measurement relies on. A rank's memory and compute depend on the shapes it holds, not on
the data its collectives move, so rank 0 of a fake world does rank 0's work. Fake collectives
finish at once and move nothing, and some would leave their outputs uninitialised, so the
exchanges the step makes fill their outputs with local data (the all-to-alls' and the ring's
receive buffers get what this rank sent, FSDP2's reduce-scatter copies this rank's own chunk
into its gradient shard): every value stays finite and of a real step's magnitudes (garbage
turns into NaN weights by the second step, and NaN or constant data draw less power, flattering
the kernels' times). The loss and gradient norm of every step are reported, and a non-finite one
is flagged.

What differs from the real rank: no collective costs any time (the plan's exposed communication
is left out of the comparison: measured time compares with the plan's compute, host transfers
and optimizer), NCCL's buffers do not exist (compare the reserved peak with the plan's allocator
peak, which leaves them out), FSDP's buffers are freed a little earlier (its collectives finish
at once), the fake all-gather copies the shard into every chunk (copy kernels where NCCL would
run its own), and host memory and the PCIe link serve one rank instead of all of a node's (the
host figures are one rank's share; offload copies see an idle link). Host memory for offloaded
activations and FSDP CPU offload is one rank's: the run is refused before anything is built when
this host cannot hold it, or when the plan's allocator peak exceeds this device.

On CPU (``--device cpu``) the same code runs with a small model, and the peak is that of the live
tensors (the planner's CPU tests' tracker, ``planning.tracker``: CPU has no caching allocator to
ask), compared with a CPU plan; the time is printed without a prediction (the step-time model
prices a CPU only with a measured profile, ``--profile``). A recipe's rank holds days of CPU
work, so before anything is built the plan's FLOPs at this CPU's matmul rate bound the run's
time, and a run past ``--cpu-minutes`` is refused in one line naming the debug model's form.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from upipe_dtensor.config import ConfigError, JobConfig, parse_args
from upipe_dtensor.models.hf_config import model_args
from upipe_dtensor.modes.fake_group import local_data_in_fake_collectives
from upipe_dtensor.modes.ops import transparent_ops
from upipe_dtensor.planning.hardware import GPU_PROFILES, load_profile
from upipe_dtensor.planning.step import NCCL_BUFFERS, Budget, plan_job, tracked_step
from upipe_dtensor.planning.tracker import LiveMemoryTracker
from upipe_dtensor.runtime.fake_process_group import (
    init_fake_process_group,
    keep_fsdp_gradients_finite,
)
from upipe_dtensor.train.build import configure_allocator, resolve_attention
from upipe_dtensor.train.setup import Placement, build_meshes
from upipe_dtensor.train.trainer import Trainer
from upipe_dtensor.verify import kernel_rates

logger = logging.getLogger(__name__)

GiB = 2**30
HOST_SHARE = 0.9
"""Of the host memory available now, the most one rank's planned host memory may take."""
CPU_MINUTES = 15.0
"""The longest CPU run the stand-in starts by default (``--cpu-minutes``): a recipe's rank holds
hours of CPU work per step, so beyond this it is refused, naming ``CPU_FORM``."""
CPU_FORM = (
    "python -m upipe_dtensor.gpu_check --stand-in --device cpu --config "
    "train_configs/debug_model.toml --parallelism.context_parallel_degree 4"
)
"""The stand-in's form for a CPU: the debug model as rank 0 of 4 (minutes; docs/gpu.md)."""
CATEGORIES = (
    "matmul",
    "attention forward",
    "attention backward",
    "memory-bound ops",
    "host transfers",
    "optimizer",
)
"""Measured time by kind, the step-time model's compute categories and the two it prices apart."""
TOP_KERNELS = 15
"""Kernels (CPU: ops) of the profiled step reported by name, the longest first."""
_MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mv", "aten::addmv"}
_GEMM_KERNELS = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitkreduce")
_ATTENTION_KERNELS = ("flash", "fmha", "sdpa", "cudnn")
"""FlashAttention (aten's FA2, FA3, FA4, flash-attn), memory-efficient (CUTLASS fmha), cuDNN (the
step runs cuDNN for attention only)."""
_BACKWARD_MARKS = ("bwd", "bprop", "backward", "cutlassb", "dq_dk_dv", "dot_do_o")


def classify(name: str, on_gpu: bool) -> str:
    """The category of a profiled kernel (GPU) or leaf op (CPU) by its name."""
    low = name.lower()
    if "adam" in low:
        return "optimizer"
    if on_gpu and low.startswith("memcpy") and ("htod" in low or "dtoh" in low):
        return "host transfers"
    attention = (
        "scaled_dot_product" in low or "flash_attention" in low
        if not on_gpu
        else any(mark in low for mark in _ATTENTION_KERNELS)
    )
    if attention:
        backward = any(mark in low for mark in _BACKWARD_MARKS)
        return "attention backward" if backward else "attention forward"
    if (on_gpu and any(mark in low for mark in _GEMM_KERNELS)) or name in _MATMUL_OPS:
        return "matmul"
    return "memory-bound ops"


def time_by_category(
    prof: torch.profiler.profile, on_gpu: bool
) -> tuple[dict[str, float], list[dict]]:
    """Seconds of one profiled step by category, and the kernels (ops) that took the most, so
    the classification by name can be checked in the report: on a GPU the kernels' device time
    (every stream, so overlapped copies count whole); on CPU the ops' own time (leaf ops; an op
    under the optimizer's step counts as the optimizer)."""
    from torch.autograd import DeviceType

    seconds: dict[str, float] = defaultdict(float)
    by_name: dict[tuple[str, str], float] = defaultdict(float)
    for event in prof.events():
        if on_gpu:
            if event.device_type != DeviceType.CUDA:
                continue
            category, took = classify(event.name, True), event.time_range.elapsed_us() / 1e6
        else:
            if event.device_type != DeviceType.CPU or not event.name.startswith("aten::"):
                continue
            parent, category = event.cpu_parent, classify(event.name, False)
            while parent is not None:
                if parent.name.startswith("Optimizer.step"):
                    category = "optimizer"
                parent = parent.cpu_parent
            took = event.self_cpu_time_total / 1e6
        seconds[category] += took
        by_name[(event.name, category)] += took
    top = sorted(by_name.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    return (
        {category: seconds.get(category, 0.0) for category in CATEGORIES},
        [{"name": name[:120], "category": cat, "seconds": t} for (name, cat), t in top],
    )


def host_memory_available() -> int:
    """Bytes of host memory available to a new allocation now (``MemAvailable``)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def refuse_what_does_not_fit(plan: dict, device: torch.device) -> None:
    """ConfigError, before anything is built, when this host cannot hold one rank's planned host
    memory (offloaded activations, FSDP CPU offload) or this device the plan's allocator peak."""
    host_need, host_free = plan["host_peak_bytes"], host_memory_available()
    if host_need > HOST_SHARE * host_free:
        raise ConfigError(
            f"one rank of this job holds {host_need / GiB:.1f} GiB of host memory "
            f"({plan.get('host_holds', 'offload')}), and this host has {host_free / GiB:.1f} GiB "
            f"available (the stand-in takes at most {HOST_SHARE:.0%}); run it on a host with more "
            "memory, or a shorter --training.seq_len"
        )
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        need = plan["allocator_peak_bytes"]
        if need > total:
            raise ConfigError(
                f"the plan's allocator peak for one rank is {need / GiB:.1f} GiB, more than "
                f"this GPU's {total / GiB:.1f} GiB: the stand-in would run out of memory; plan "
                "the job (python -m upipe_dtensor.plan) for a GPU that holds it"
            )


def cpu_matmul_flops() -> float:
    """This CPU's float32 matmul rate now, FLOP/s: one 1024-square product, timed as the kernel
    rates are (``kernel_rates.seconds_per_call``), in well under a second. A step's matmuls run
    near it, its attention and memory-bound ops slower."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return 2 * 1024**3 / kernel_rates.seconds_per_call(lambda: a @ b, torch.device("cpu"))


def refuse_a_cpu_run_too_long(plan: dict, steps: int, minutes: float, what: str) -> None:
    """ConfigError, before anything is built, when the plan's counted FLOPs at this CPU's matmul
    rate put the run's steps past ``minutes``: a lower bound (attention and memory-bound ops run
    slower than matmuls), so a refused run would take at least that long. A plan made beforehand
    without the count is not judged."""
    flops = plan.get("compute_flops")
    if not flops:
        return
    rate = cpu_matmul_flops()
    runs = steps + 3  # what measure takes on CPU: the tracked step, the warm-up, the profiled one
    seconds = runs * flops / rate
    if seconds > 60 * minutes:
        raise ConfigError(
            f"{what} on CPU would take at least {_duration(seconds)}: one step counts "
            f"{flops:.3g} FLOPs of matmul and attention (its plan) and this CPU multiplies at "
            f"{rate:.3g} FLOP/s (float32, measured now), times the {runs} steps the run takes; "
            f"past --cpu-minutes {minutes:g}. The form that runs on a CPU in minutes is the "
            f"debug model's: {CPU_FORM} (or raise --cpu-minutes to wait)"
        )


def _duration(seconds: float) -> str:
    """``seconds`` in the largest unit that keeps it above 1 (minutes, hours, days)."""
    for unit, size in (("days", 86400), ("hours", 3600)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds / 60:.0f} minutes"


def _stand_in_config(argv: list[str], device: str, dump: str) -> JobConfig:
    return parse_args([
        *argv,
        "--checkpoint.enable", "false",
        "--metrics.enable_tensorboard", "false",
        "--job.dump_folder", dump,
        "--job.device", device,
    ])  # fmt: skip


def plan_for(config: JobConfig, world: int, device: torch.device, plan_path: str | None) -> dict:
    """The plan of this job as rank 0 of ``world`` on ``device``'s kind, with the attention
    backend that runs here (a GPU plan priced for this GPU): ``plan_path`` (``plan --json`` of the
    same job made beforehand, or a folder of them named ``RECIPE.BACKEND.PROFILE.json``, so the
    lent GPU's minutes go to measuring) when it matches, else planned now."""
    profile = kernel_rates.gpu_profile(device)
    profile_name = profile.name if profile else "cpu"
    backend = config.parallelism.attention_backend
    path = Path(plan_path) if plan_path else None
    if path is not None and path.is_dir():
        path = path / f"{Path(config.config_file or 'job').stem}.{backend}.{profile_name}.json"
    if path is not None and path.is_file():
        plan = json.loads(path.read_text())
        expected = {
            "seq_len": config.training.seq_len,
            "world_size": world,
            "attention_backend": backend,
            "traced_on": device.type,
            "compiled": config.compile.enable,
        }
        speed = plan.get("speed") or {}
        if all(plan.get(k) == v for k, v in expected.items()) and (
            device.type == "cpu" or speed.get("profile") == profile_name
        ):
            plan["source"] = f"made beforehand ({path})"
            return plan
    if device.type == "cuda":
        budget = Budget(
            device_bytes=torch.cuda.get_device_properties(device).total_memory, gpu=profile_name
        )
        plan = plan_job(config, budget, world, target="cuda").as_dict()
    else:
        plan = plan_job(config, Budget(), world, target="cpu").as_dict()
    plan["source"] = "planned here"
    return plan


@dataclasses.dataclass
class Measured:
    """What the stand-in measured (bytes, seconds)."""

    peak_allocated_bytes: int
    """CUDA: ``max_memory_allocated`` over the timed steps; CPU: the live tensors' peak."""
    peak_reserved_bytes: int | None
    device_in_use_bytes: int | None
    """CUDA: the device's memory in use after the steps (total minus free: the context, every
    reserved segment, anything outside torch's allocator)."""
    host_offload_peak_bytes: int
    alloc_retries: int | None
    step_seconds: list[float]
    losses: list[float]
    grad_norms: list[float]
    by_category_s: dict[str, float]
    top_kernels: list[dict]
    profiled_step_s: float
    build_and_first_step_s: float
    """Building the model and its first step (which compiles the blocks)."""

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in (*self.losses, *self.grad_norms))


def _one_step(
    trainer: Trainer, batches, device: torch.device, what: str
) -> tuple[float, float, float]:
    """One training step, timed to its last kernel; a progress line, logged to stderr (the
    command's stdout is its report): a run stopped at its time limit has told how far it got."""
    began = time.perf_counter()
    loss, grad_norm = trainer.train_step(batches)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - began
    logger.info("stand-in: %s: %.2f s, loss %.4g", what, seconds, float(loss))
    return seconds, float(loss), float(grad_norm)


def _built(config: JobConfig, world: int, device: torch.device) -> Trainer:
    """The job as rank 0 of ``world`` on the fake group, FSDP2's reduce-scatters kept finite."""
    parallelism = config.parallelism
    cp = parallelism.context_parallel_degree
    meshes = build_meshes(device.type, world // cp, cp, parallelism.ring_degree)
    trainer = Trainer(config, placement=Placement(meshes=meshes, device=device))
    keep_fsdp_gradients_finite(trainer.model)
    return trainer


def measure(config: JobConfig, world: int, device: torch.device, steps: int) -> Measured:
    """Rank 0 of ``world`` on ``device`` under a fake group (module docstring): a warm-up step,
    ``steps`` timed ones (CUDA: with fresh peak statistics) and a profiled one; on CPU the
    memory is that of a tracked step before them (the planner's CPU tests' method: the model
    built inside the tracker, the custom ops transparent)."""
    training = config.training
    cuda = device.type == "cuda"
    init_fake_process_group(world)
    try:
        began = time.perf_counter()
        with local_data_in_fake_collectives():
            if cuda:
                trainer = _built(config, world, device)
            else:
                tracker = LiveMemoryTracker()
                with transparent_ops(), tracker:
                    trainer = _built(config, world, device)
                    tracked_step(trainer, tracker, config)
            vocab = trainer.setup.tokenizer.vocab_size
            generator = torch.Generator().manual_seed(0)
            shape = (training.local_batch_size, training.seq_len + 1)
            tokens = torch.randint(0, vocab, shape, generator=generator)
            batches = [(tokens[:, :-1], tokens[:, 1:])] * training.gradient_accumulation_steps
            _one_step(trainer, batches, device, "warm-up step")  # CPU: out of the tracker's mode
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
            first = time.perf_counter() - began
            timed = [
                _one_step(trainer, batches, device, f"timed step {i + 1}") for i in range(steps)
            ]
            activity = torch.profiler.ProfilerActivity
            with torch.profiler.profile(activities=[activity.CUDA if cuda else activity.CPU]) as p:
                profiled, *_ = _one_step(trainer, batches, device, "profiled step")
        by_category, top = time_by_category(p, cuda)
        offload = trainer.host_offload
        if cuda:
            free, total = torch.cuda.mem_get_info(device)
            peak = torch.cuda.max_memory_allocated(device)
            reserved, in_use = torch.cuda.max_memory_reserved(device), total - free
            retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries
        else:
            peak, reserved, in_use, retries = tracker.peaks[str(device)].bytes, None, None, None
        return Measured(
            peak_allocated_bytes=peak,
            peak_reserved_bytes=reserved,
            device_in_use_bytes=in_use,
            host_offload_peak_bytes=offload.peak_host_bytes if offload else 0,
            alloc_retries=retries,
            step_seconds=[seconds for seconds, _, _ in timed],
            losses=[loss for _, loss, _ in timed],
            grad_norms=[norm for _, _, norm in timed],
            by_category_s=by_category,
            top_kernels=top,
            profiled_step_s=profiled,
            build_and_first_step_s=first,
        )
    finally:
        dist.destroy_process_group()


def planned_times(plan: dict) -> dict[str, float] | None:
    """The plan's time per measured category (``CATEGORIES``), and the step it compares with the
    measured one (compute, exposed host transfers, optimizer: no collectives); None without a
    prediction. Host transfers are all of the step's copies at the profile's central link rate
    (the measured kernels count them whole, though most overlap compute)."""
    speed = plan.get("speed")
    if not speed:
        return None
    compute, breakdown = speed["compute_s"], speed["time_breakdown_s"]
    profile = GPU_PROFILES.get(speed["profile"])
    copied = sum(v for k, v in speed["work"].items() if k.startswith("host copies"))
    times = {
        "matmul": compute["matmul"],
        "attention forward": compute["attention forward"],
        "attention backward": compute["attention backward"],
        "memory-bound ops": compute["memory-bound ops"] + compute.get("op dispatch", 0.0),
        "host transfers": copied / profile.host_link_bytes_per_s
        if profile
        else breakdown["exposed host transfers"],
        "optimizer": breakdown["optimizer"],
    }
    times["step without collectives"] = (
        sum(compute.values()) + breakdown["exposed host transfers"] + breakdown["optimizer"]
    )
    return times


def in_step_rates(plan: dict, measured: dict[str, float]) -> list[dict]:
    """The plan's counted work over the measured time of its category: the rates the kernels
    reached inside the step, beside the range of the plan's GPU profile for each (none on CPU)."""
    speed = plan.get("speed") or {}
    work = speed.get("work") or {}
    backend = plan["attention_backend"]
    attention = {
        direction: sum(v for k, v in work.items() if k.startswith("attention FLOPs") and mark in k)
        for direction, mark in (("forward", "forward"), ("backward", "backward"))
    }
    host = sum(v for k, v in work.items() if k.startswith("host copies"))
    rows = [  # (category, counted work, unit, the profile's constant)
        ("matmul", work.get("matmul FLOPs", 0.0), "FLOP/s", "matmul_flops"),
        (
            "attention forward",
            attention["forward"],
            "FLOP/s",
            f"attention.{backend}.forward_causal",
        ),
        ("attention backward", attention["backward"], "FLOP/s", f"attention.{backend}.backward"),
        ("memory-bound ops", work.get("memory-bound bytes", 0.0), "B/s", "memory_bytes_per_s"),
        ("host transfers", host, "B/s", "host_link_bytes_per_s"),
    ]
    profile = GPU_PROFILES.get(speed.get("profile", ""))
    result = []
    for category, amount, unit, constant in rows:
        seconds = measured[category]
        if not amount or not seconds:
            continue
        low, high = kernel_rates.profile_range(profile, constant)
        rate = amount / seconds
        result.append({"category": category, "rate": rate, "unit": unit, "low": low,
                       "high": high, "verdict": kernel_rates.verdict(rate, low, high)})  # fmt: skip
    return result


def report(config: JobConfig, world: int, plan: dict, measured: Measured, device_name: str):
    """The stand-in's result as a dict (``--json``) and as lines to print (``device_name``:
    the GPU's, or "CPU")."""
    on_gpu = device_name != "CPU"
    nccl = sum(v for k, v in plan["device_breakdown"].items() if k.startswith(NCCL_BUFFERS))
    memory = [  # (what, measured, planned, how the two are measured)
        (
            "peak allocated",
            measured.peak_allocated_bytes,
            plan["tracked_peak_bytes"],
            "torch.cuda.max_memory_allocated vs the plan's tracked peak"
            if on_gpu
            else "live tensors of a tracked step (the planner's CPU tests' method) vs the plan",
        ),
    ]
    if on_gpu:
        memory += [
            (
                "peak reserved",
                measured.peak_reserved_bytes,
                plan["allocator_peak_bytes"],
                "torch.cuda.max_memory_reserved vs the plan's allocator peak (no context, no NCCL)",
            ),
            (
                "device in use after the steps",
                measured.device_in_use_bytes,
                plan["device_peak_bytes"] - nccl,
                "total minus free vs the plan's device peak without NCCL's buffers",
            ),
        ]
    memory.append(
        (
            "host (offloaded activations)",
            measured.host_offload_peak_bytes,
            plan["host_peak_bytes"],
            "the offload store's peak vs the plan's host memory per rank"
            + (" (incl. FSDP CPU offload's states)" if config.training.enable_cpu_offload else ""),
        )
    )
    planned = planned_times(plan)
    mean_step = sum(measured.step_seconds) / max(len(measured.step_seconds), 1)
    result = {
        "config_file": config.config_file,
        "device": device_name,
        "torch": torch.__version__,
        "world_size": world,
        "rank": 0,
        "seq_len": config.training.seq_len,
        "attention": plan["attention"],
        "attention_backend": plan["attention_backend"],
        "compiled": plan["compiled"],
        "plan_source": plan.get("source", ""),
        "plan_profile": (plan.get("speed") or {}).get("profile"),
        "memory": [
            {"what": what, "measured_bytes": got, "planned_bytes": want, "how": how}
            for what, got, want, how in memory
        ],
        "alloc_retries": measured.alloc_retries,
        "step_seconds": measured.step_seconds,
        "mean_step_s": mean_step,
        "build_and_first_step_s": measured.build_and_first_step_s,
        "profiled_step_s": measured.profiled_step_s,
        "measured_by_category_s": measured.by_category_s,
        "top_kernels": measured.top_kernels,
        "planned_by_category_s": planned,
        "in_step_rates": in_step_rates(plan, measured.by_category_s),
        "losses": measured.losses,
        "grad_norms": measured.grad_norms,
        "finite": measured.finite,
    }
    return result, render(result)


def _gib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / GiB:.2f} GiB"


def render(result: dict) -> list[str]:
    lines = [
        f"stand-in: {result['config_file']} as rank 0 of {result['world_size']} (fake process "
        f"group), {result['device']}, torch {result['torch']}, {result['attention']}, "
        f"{result['attention_backend']} attention, "
        f"{'compiled' if result['compiled'] else 'eager'} blocks; plan {result['plan_source']}",
        f"  {'memory':<32s} {'measured':>11s} {'planned':>11s} {'ratio':>6s}",
    ]
    for row in result["memory"]:
        got, want = row["measured_bytes"], row["planned_bytes"]
        ratio = f"{got / want:.3f}" if got is not None and want else "n/a"
        lines.append(f"  {row['what']:<32s} {_gib(got):>11s} {_gib(want):>11s} {ratio:>6s}  "
                     f"({row['how']})")  # fmt: skip
    if result["alloc_retries"]:
        lines.append(f"  allocator retries (cudaMalloc failed, cache flushed): "
                     f"{result['alloc_retries']}")  # fmt: skip
    planned = result["planned_by_category_s"]
    profile = f"predicted, {result['plan_profile']}" if planned else "no prediction"
    lines.append(f"  {'step time':<32s} {'measured':>11s} {profile:>11s}")
    wall = f"{result['mean_step_s']:.3f} s"
    want = f"{planned['step without collectives']:.3f} s" if planned else "n/a"
    lines.append(f"  {'step (mean of timed steps)':<32s} {wall:>11s} {want:>11s}  (wall time; "
                 "predicted: compute, host transfers and optimizer, no collectives)")  # fmt: skip
    for category in CATEGORIES:
        got = f"{result['measured_by_category_s'][category]:.3f} s"
        want = f"{planned[category]:.3f} s" if planned else "n/a"
        lines.append(f"    {category:<30s} {got:>11s} {want:>11s}")
    kernels = sum(result["measured_by_category_s"].values())
    lines.append(f"    {'(profiled step, wall)':<30s} {result['profiled_step_s']:>9.3f} s "
                 f"{'':>11s}  kernels/ops sum to {kernels:.3f} s")  # fmt: skip
    lines.append("  longest kernels (ops on CPU) of the profiled step, by name:")
    lines += [
        f"    {row['seconds'] * 1e3:9.2f} ms  {row['category']:<18s} {row['name'][:90]}"
        for row in result["top_kernels"][:8]
    ]
    scaled = kernel_rates.scaled
    for row in result["in_step_rates"]:
        lines.append(
            f"    in-step rate, {row['category']:<18s} {scaled(row['rate'], row['unit'])}"
            f"{row['unit']} (range {scaled(row['low'], row['unit'])}-"
            f"{scaled(row['high'], row['unit'])}: {row['verdict']})"
        )
    lines.append(f"  build and first step (compiles): {result['build_and_first_step_s']:.1f} s")
    values = ", ".join(f"{loss:.3g}/{norm:.3g}" for loss, norm in
                       zip(result["losses"], result["grad_norms"]))  # fmt: skip
    verdict = "finite" if result["finite"] else "NOT FINITE: timings may be flattered"
    lines.append(f"  loss / grad norm per timed step: {values} ({verdict})")
    return lines


def run(
    argv: list[str],
    device_type: str,
    steps: int = 3,
    world: int | None = None,
    plan_file: str | None = None,
    json_path: str | None = None,
    profile_path: str | None = None,
    cpu_minutes: float = CPU_MINUTES,
) -> dict:
    """The stand-in run (module docstring); returns the report's dict."""
    config = _stand_in_config(argv, device_type, tempfile.mkdtemp(prefix="stand_in-"))
    configure_allocator(config)  # before the first CUDA allocation (the kernel probe's)
    world = world or config.parallelism.world_size
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "--stand-in on cuda needs a usable GPU; --device cpu runs it on CPU, where a "
                f"recipe's rank takes hours a step: the CPU form is {CPU_FORM}"
            )
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    args = model_args(config.model, config.training.seq_len)
    choice = resolve_attention(config, args, device.type, traced=False)  # the probe runs here
    parallelism = dataclasses.replace(config.parallelism, attention_backend=choice.backend)
    config = dataclasses.replace(config, parallelism=parallelism)
    plan = plan_for(config, world, device, plan_file)
    if profile_path and device.type == "cpu":
        priced = plan_job(config, Budget(), world, target="cpu", profile=load_profile(profile_path))
        plan["speed"] = priced.as_dict()["speed"]
    logger.info(
        "stand-in: plan %s: tracked peak %.2f GiB, %s attention",
        plan["source"],
        plan["tracked_peak_bytes"] / GiB,
        plan["attention_backend"],
    )
    refuse_what_does_not_fit(plan, device)
    if device.type == "cpu":
        what = f"{config.config_file} as rank 0 of {world}"
        refuse_a_cpu_run_too_long(plan, steps, cpu_minutes, what)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    result, lines = report(config, world, plan, measure(config, world, device, steps), name)
    print("\n".join(lines), flush=True)  # the command's output: the measured-vs-planned report
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--stand-in (one device as rank 0 of the recipe's world)")
    group.add_argument("--config", help="the recipe (with --section.key overrides after it)")
    group.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    group.add_argument("--world-size", type=int, default=None,
                       help="ranks the device stands in for (default: the recipe's)")  # fmt: skip
    group.add_argument(
        "--plan",
        default=None,
        help="plan --json of the same job made beforehand (used when it matches)",
    )
    group.add_argument("--cpu-minutes", type=float, default=CPU_MINUTES,
                       help="CPU only: refuse a run whose plan's FLOPs at this CPU's measured "
                       f"matmul rate take longer (default {CPU_MINUTES:g})")  # fmt: skip
    group.add_argument("--profile", default=None,
                       help="CPU only: a measured profile (benchmarks/cpu_profile.py) to price "
                       "the plan")  # fmt: skip
