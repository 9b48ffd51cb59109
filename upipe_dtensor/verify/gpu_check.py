"""A user's first GPU run: every style against the unsharded model, and one step of the 8B shape.

    torchrun --nproc_per_node N -m upipe_dtensor.gpu_check        # N from 1 to 8, one node
    python -m upipe_dtensor.gpu_check --stand-in --config RECIPE  # one GPU as rank 0 of a recipe

More ranks than GPUs share them (rank r on GPU LOCAL_RANK mod the GPUs): NCCL refuses two ranks on
one device, so such a run's group is gloo, whose collectives take CUDA tensors (the ring's sends
go through host memory, ``runtime.group_backends.stages_through_host``); the parity rows then check
the GPU's kernels and the styles' arithmetic, not NCCL, and the step is left to ``--stand-in``
(``verify.stand_in``), which measures a recipe's rank 0 beside its plan.

1. Parity. Each context-parallel style (UPipe, Ulysses, ring, FPDT, UPipe x FPDT, and 2D UPipe on
   4 or 8 GPUs) runs a small torchtitan Llama3 (GQA, head_dim 64) in bf16 with every attention
   backend that works here (fa3, fa4, cudnn, flash, sdpa; the others are listed with the reason),
   against a float64 copy of the unsharded model. Beside each error stands the unsharded bf16
   model's own: the ratio is what the CPU tests bound by 1.5 (``tests/test_bf16.py``).
2. Speed and memory. One training step of the 8B shape (``train_configs/llama3_8b_base.toml``, the
   whole node on one sequence of ``--tokens-per-gpu`` x N tokens, FSDP CPU offload when the
   planner says the model states do not fit): tokens/s per GPU and the peak allocated and
   reserved memory, beside the planner's prediction for the same job (``plan_job``, the same
   traced CUDA kernels).

Everything it calls is what the traced CUDA-branch tests run on fake tensors
(``tests/test_cuda_traced.py``): the styles, the kernel backends, the trainer's step. The table
at the end (markdown) is made to be pasted into an issue. ``--device cpu`` runs the same code on
CPU processes (sdpa only, the debug flavor for the step), as a smoke test.

It exists to report failures, so it survives them: a backend takes part only where it passes the
kernel probe on every rank (``kernels.probe``); a (style, backend) or the step that raises on any
rank is a "failed: ..." row on every rank (``outcome_on_every_rank``), and the check goes on. A
failure that leaves some ranks inside a collective the failing one never joins cannot be agreed
on; the process group's timeout (10 minutes) then ends the run. The allocator settings are made
on every rank before its first CUDA allocation, the 2D mesh (new NCCL communicators) is built
once, each backend's models and pinned host buffers are freed before the next, and the step is
planned with the backend it will run here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from upipe_dtensor.config import ConfigError, parse_args
from upipe_dtensor.kernels.backends import BACKENDS, activate_backend, choose_backend
from upipe_dtensor.models.generation import family_module
from upipe_dtensor.models.hf_config import model_args
from upipe_dtensor.parallel import ContextParallelAttention
from upipe_dtensor.parallel.registry import STYLES, make_style
from upipe_dtensor.parallel.style_options import Geometry
from upipe_dtensor.planning.step import Budget, Plan, plan_job
from upipe_dtensor.runtime.collectives import outcome_on_every_rank
from upipe_dtensor.runtime.errors import run_main
from upipe_dtensor.runtime.parity import (
    cast_parameters,
    gather_sequence,
    rel_err,
    shard,
    summed_grads,
    worst_grad_err,
)
from upipe_dtensor.runtime.process_group import process_group_backend
from upipe_dtensor.train.build import configure_allocator
from upipe_dtensor.train.trainer import Trainer
from upipe_dtensor.verify import kernel_rates, stand_in

GiB = 2**30
HEADS, KV_HEADS, HEAD_DIM, VOCAB = 8, 4, 64, 256
TOKENS_PER_RANK = 512
"""The parity check's sequence: this many tokens per CP rank."""


@dataclasses.dataclass
class ParityRow:
    style: str
    backend: str
    logits_err: float
    grad_err: float
    reference_logits_err: float
    reference_grad_err: float

    @property
    def ratio(self) -> float:
        """The style's worst error over the unsharded bf16 model's."""
        return max(
            self.logits_err / max(self.reference_logits_err, 1e-30),
            self.grad_err / max(self.reference_grad_err, 1e-30),
        )


def cp_degree(world: int) -> int:
    """The largest power of two (<= 8) dividing the GPUs: the 8B model's 32 heads and the small
    model's 8 split over it; the other ranks are data parallel."""
    degree = 1
    while degree < 8 and world % (degree * 2) == 0:
        degree *= 2
    return degree


def available_backends(device_type: str) -> tuple[list[str], dict[str, str]]:
    """The backends that run here on every rank (installed, and passing the kernel probe with
    the small model's head_dim in bf16), and why each other one does not."""
    working, skipped = [], {}
    for name in BACKENDS:
        if name == "auto":
            continue
        try:
            dtype = torch.bfloat16 if device_type == "cuda" else None
            choose_backend(name, device_type, head_dim=HEAD_DIM, dtype=dtype)
            working.append(name)
        except ValueError as err:
            skipped[name] = str(err)
    if dist.is_initialized() and dist.get_world_size() > 1:  # what runs on every rank
        every: list[tuple[list[str], dict[str, str]]] = [([], {})] * dist.get_world_size()
        dist.all_gather_object(every, (working, skipped))
        skipped = {name: why for _, theirs in reversed(every) for name, why in theirs.items()}
        working = [name for name in working if name not in skipped]
    return working, skipped


def _styles(
    cp: int, seq_len: int, backend: str, device_type: str, two_d: DeviceMesh | None
) -> dict[str, tuple[ContextParallelAttention, DeviceMesh | None]]:
    """Each style, and the mesh it runs on when not the 1-D CP mesh (2D UPipe: ``two_d``): the
    built-ins in their published and UPipe x FPDT forms, a style registered later in its own."""
    kernels = {"backend": backend, "kernel_device": device_type}
    chunks = {"chunk_tokens": seq_len // 4}
    cases: dict[str, dict] = {
        "UPipe (U = C)": {"cp_style": "upipe"},
        "Ulysses": {"cp_style": "ulysses"},
        "ring": {"cp_style": "ring"},
        "FPDT (4 chunks)": {"cp_style": "fpdt", **chunks},
        "UPipe x FPDT (4 chunks)": {"cp_style": "upipe", **chunks},
    }
    named = {case["cp_style"] for case in cases.values()}
    for name, spec in STYLES.items():  # a style registered later, in its default form
        if name not in named:
            cases[spec.label] = {"cp_style": name}
    styles: dict[str, tuple[ContextParallelAttention, DeviceMesh | None]] = {
        label: (make_style(case, **kernels), None) for label, case in cases.items()
    }
    if two_d is not None:
        two_d_upipe = make_style({"cp_style": "upipe"}, Geometry(ring_degree=2), **kernels)
        styles["2D UPipe (2 x C/2)"] = (two_d_upipe, two_d)
    return styles


def two_d_mesh(cp: int, device_type: str) -> DeviceMesh | None:
    """The (cp_ring, cp_heads) mesh of 2D UPipe, built once (its process groups are NCCL
    communicators, which are not freed): 2 x C/2 when the whole world is one CP group of 4+."""
    if cp < 4 or cp != dist.get_world_size():
        return None
    return init_device_mesh(device_type, (2, cp // 2), mesh_dim_names=("cp_ring", "cp_heads"))


def _small_model(seq_len: int, device: torch.device) -> nn.Module:
    """torchtitan's own small Llama3 (of the installed generation), seed 0, on ``device``."""
    torch.manual_seed(0)
    with torch.device(device):
        return family_module("llama3").torchtitan_model(
            dim=HEADS * HEAD_DIM, n_layers=2, n_heads=HEADS, n_kv_heads=KV_HEADS,
            vocab_size=VOCAB, seq_len=seq_len, rope_theta=500000.0,
        )  # fmt: skip


def _loss_and_grads(model: nn.Module, tokens, labels, seq_len: int, style=None, mesh=None):
    """Logits of the whole sequence and gradients summed over the CP ranks in float32."""
    group = mesh.get_group() if mesh is not None else None
    rank = mesh.get_local_rank() if mesh is not None else 0
    world = mesh.size() if mesh is not None else 1
    logits = model(shard(tokens, rank, world, style))
    local_labels = shard(labels, rank, world, style)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), local_labels.flatten(), reduction="sum")
    (loss / seq_len).backward()
    if mesh is None:
        return logits.detach(), {n: p.grad.float() for n, p in model.named_parameters()}
    return gather_sequence(logits.detach(), style, group), summed_grads(model, group)


@dataclasses.dataclass
class FailedRow:
    """A (style, backend) that raised: reported in the table instead of ending the check."""

    style: str
    backend: str
    error: str


def _free(device: torch.device) -> None:
    """Give back what a backend's styles built: models, host stores (their pinned memory is
    unregistered when collected, ``HostStore.free``) and cached device memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_parity(
    mesh: DeviceMesh, device: torch.device, backends: list[str], two_d: DeviceMesh | None = None
) -> list[ParityRow | FailedRow]:
    """Every style with every backend against the float64 unsharded model (module docstring).
    A (style, backend) that fails on any rank is a failed row on every rank, and the check goes
    on with the next one."""
    cp = mesh.size()
    seq_len = TOKENS_PER_RANK * cp
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (1, seq_len + 1), generator=generator).to(device)
    batch = _Batch(tokens[:, :-1], tokens[:, 1:], seq_len, device)
    exact = _small_model(seq_len, device)
    cast_parameters(exact, torch.float64)
    batch.exact_logits, batch.exact_grads = _loss_and_grads(exact, *batch.tokens_and_labels)
    rows: list[ParityRow | FailedRow] = []
    for backend in backends:
        reference, failure = outcome_on_every_rank(functools.partial(_plain_errors, batch, backend))
        styles = _styles(cp, seq_len, backend, device.type, two_d)
        for name, (style, style_mesh) in styles.items():
            errors, style_failure = None, failure
            if failure is None:
                run = functools.partial(_style_errors, batch, style, style_mesh or mesh, mesh)
                errors, style_failure = outcome_on_every_rank(run)
            if style_failure is not None:
                rows.append(FailedRow(name, backend, _one_line(style_failure)))
            else:
                rows.append(ParityRow(name, backend, *errors, *reference))
        del styles
        _free(device)
    return rows


@dataclasses.dataclass
class _Batch:
    """The parity check's sequence and the float64 model's answers on it."""

    tokens: torch.Tensor
    labels: torch.Tensor
    seq_len: int
    device: torch.device
    exact_logits: torch.Tensor | None = None
    exact_grads: dict | None = None

    @property
    def tokens_and_labels(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.tokens, self.labels, self.seq_len

    def errors(self, logits: torch.Tensor, grads: dict) -> tuple[float, float]:
        return rel_err(logits, self.exact_logits), worst_grad_err(grads, self.exact_grads)


def _plain_errors(batch: _Batch, backend: str) -> tuple[float, float]:
    """The unsharded bf16 model's errors with ``backend``'s kernels."""
    if batch.device.type == "cuda":
        activate_backend(backend)  # FA3/FA4 take over aten's flash ops process-wide
    plain = _small_model(batch.seq_len, batch.device)
    cast_parameters(plain, torch.bfloat16)
    return batch.errors(*_loss_and_grads(plain, *batch.tokens_and_labels))


def _style_errors(
    batch: _Batch, style: ContextParallelAttention, style_mesh: DeviceMesh, mesh: DeviceMesh
) -> tuple[float, float]:
    """A style's errors in bf16 (its logits gathered and gradients summed over ``mesh``)."""
    model = _small_model(batch.seq_len, batch.device)
    cast_parameters(model, torch.bfloat16)
    parallelize_module(model, style_mesh, {"layers.*.attention": style})
    return batch.errors(*_loss_and_grads(model, *batch.tokens_and_labels, style, mesh))


def _one_line(err: Exception) -> str:
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= 160 else text[:157] + "..."


@dataclasses.dataclass
class StepRow:
    job: str
    tokens_per_s_per_gpu: float
    allocated_gib: float
    reserved_gib: float
    planned_tracked_gib: float
    planned_total_gib: float


def _step_config(
    args: argparse.Namespace, world: int, dump: str, offload: bool, backend: str = "auto"
):
    cp = cp_degree(world)
    return parse_args([
        "--config", args.recipe,
        "--model.flavor", args.flavor,
        "--training.seq_len", str(args.tokens_per_gpu * cp),
        "--training.enable_cpu_offload", str(offload).lower(),
        "--parallelism.context_parallel_degree", str(cp),
        "--parallelism.heads_per_stage", "none",  # unset: the default U
        "--parallelism.attention_backend", backend,
        "--checkpoint.enable", "false",
        "--metrics.enable_tensorboard", "false",
        "--job.dump_folder", dump,
        "--job.device", args.device,
    ])  # fmt: skip


def step_backend(args: argparse.Namespace, world: int, dump: str) -> str:
    """The attention backend the step runs on this GPU: the recipe's, resolved here as the trainer
    resolves it (installed, passing the probe with the model's head_dim in bf16), so the plan
    prices the kernel that runs, not the planner's Hopper-with-FA3 default."""
    config = _step_config(args, world, dump, offload=False)
    if args.device != "cuda":
        return "sdpa"
    shape = model_args(config.model, config.training.seq_len)
    return choose_backend(
        config.parallelism.attention_backend,
        "cuda",
        documents=config.training.attention_mask == "document",
        head_dim=shape.resolved_head_dim,
        dtype=torch.bfloat16,
    ).backend


def plan_step(args: argparse.Namespace, world: int, dump: str) -> tuple[object, Plan]:
    """The planner's prediction for the step, before any real process group exists (the planner
    makes a fake one); FSDP CPU offload is turned on when the plan does not fit without it."""
    budget = Budget(device_bytes=_device_bytes(args.device))
    backend = step_backend(args, world, dump)
    for offload in (False, True):
        config = _step_config(args, world, dump, offload, backend)
        plan = plan_job(config, budget, world, target="cuda" if args.device == "cuda" else "cpu")
        if plan.fits:
            break
    return config, plan


def _device_bytes(device_type: str) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    return 80 * GiB


def measure_step(config, plan: Plan) -> StepRow:
    """A warm-up step, then one timed step with fresh peak-memory statistics."""
    trainer = Trainer(config)
    seq_len = config.training.seq_len
    tokens = torch.randint(0, trainer.setup.tokenizer.vocab_size, (1, seq_len))
    cuda = trainer.device.type == "cuda"
    trainer.train_step([(tokens, tokens)])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    began = time.perf_counter()
    trainer.train_step([(tokens, tokens)])
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    return StepRow(
        job=f"{config.model.name} {config.model.flavor}, {seq_len:,} tokens, {plan.attention}"
        + (", FSDP CPU offload" if config.training.enable_cpu_offload else ""),
        tokens_per_s_per_gpu=seq_len / seconds / trainer.setup.cp,
        allocated_gib=(torch.cuda.max_memory_allocated() if cuda else 0) / GiB,
        reserved_gib=(torch.cuda.max_memory_reserved() if cuda else 0) / GiB,
        planned_tracked_gib=plan.tracked_peak_bytes / GiB,
        planned_total_gib=plan.device_peak_bytes / GiB,
    )


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "CPU"


def render(
    world: int,
    device: str,
    parity: list[ParityRow | FailedRow],
    skipped: dict[str, str],
    step: StepRow | None,
    step_failure: str = "",
    backend: str = "",
) -> str:
    gpus = torch.cuda.device_count() if device == "cuda" else world
    where = f"{world} ranks on {gpus} x {_device_name(device)}" + (
        f", {backend}" if backend else ""
    )
    lines = [
        f"### upipe-dtensor gpu_check: {where}, torch {torch.__version__}",
        "",
        "| style | backend | logits err | grad err | unsharded bf16 logits / grad err | ratio |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in parity:
        if isinstance(r, FailedRow):
            lines.append(f"| {r.style} | {r.backend} | failed: {r.error} | | | |")
            continue
        lines.append(
            f"| {r.style} | {r.backend} | {r.logits_err:.2e} | {r.grad_err:.2e} | "
            f"{r.reference_logits_err:.2e} / {r.reference_grad_err:.2e} | {r.ratio:.2f} |"
        )
    lines += [f"| (skipped) | {b} | {why} | | | |" for b, why in skipped.items()]
    if step is not None or step_failure:
        lines += [
            "",
            "| step | tokens/s/GPU | allocated GiB | reserved GiB | planned (tracked) GiB "
            "| planned (with CUDA allowances) GiB |",
            "|---|---:|---:|---:|---:|---:|",
        ]
    if step_failure:
        lines.append(f"| {step_failure} | | | | | |")
    elif step is not None:
        lines.append(
            f"| {step.job} | {step.tokens_per_s_per_gpu:,.0f} | "
            + (
                f"{step.allocated_gib:.2f} | {step.reserved_gib:.2f}"
                if device == "cuda"
                else "n/a | n/a"
            )
            + f" | {step.planned_tracked_gib:.2f} | {step.planned_total_gib:.2f} |"
        )
    return "\n".join(lines)


def shares_gpus(device_type: str) -> bool:
    """Whether this node runs more ranks than it has GPUs (they share them; module docstring)."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    return device_type == "cuda" and ranks > torch.cuda.device_count()


def run(args: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if "RANK" not in os.environ:
        raise ConfigError("gpu_check runs under torchrun: torchrun --nproc_per_node N -m ...")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("gpu_check needs CUDA here; --device cpu runs the same code on CPUs")
    dump = tempfile.mkdtemp(prefix="gpu_check-")
    # Every rank, before its first CUDA allocation (the kernel probes, the plan, the parity).
    configure_allocator(_step_config(args, world, dump, offload=False))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    shared = shares_gpus(args.device)
    if args.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu", local_rank)
    step = args.step and not shared  # the trainer puts rank r on GPU r: --stand-in instead
    planned = plan_step(args, world, dump) if step and rank == 0 else None  # no group yet
    # gloo beside NCCL: the step may run with FSDP CPU offload (runtime.process_group).
    backend = process_group_backend(args.device, host_tensors=True, shared_gpu=shared)
    dist.init_process_group(backend, timeout=timedelta(minutes=10))
    backends, skipped = available_backends(args.device)
    cp = cp_degree(world)
    mesh = init_device_mesh(args.device, (world // cp, cp), mesh_dim_names=("dp", "cp"))["cp"]
    parity = check_parity(mesh, device, backends, two_d_mesh(cp, args.device))
    step_row, step_failure = None, None
    if step:
        broadcast = [planned]  # rank 0's (config, plan) to every rank
        dist.broadcast_object_list(broadcast)
        step_row, step_failure = outcome_on_every_rank(lambda: measure_step(*broadcast[0]))
    if rank == 0:
        failure = f"failed: {_one_line(step_failure)}" if step_failure is not None else ""
        if args.step and shared:
            failure = f"not run: {world} ranks share the GPU(s); --stand-in measures the step"
        # The command's output: the table to paste into an issue (its log lines: stderr).
        print(render(world, args.device, parity, skipped, step_row, failure, backend), flush=True)
        if args.json:
            results = {
                "world_size": world,
                "process_group": backend,
                "device": _device_name(args.device),
                "torch": torch.__version__,
                "parity": [
                    dataclasses.asdict(row)
                    | {"failed": isinstance(row, FailedRow), "ratio": getattr(row, "ratio", None)}
                    for row in parity
                ],
                "skipped": skipped,
                "step": dataclasses.asdict(step_row) if step_row else None,
                "step_failure": failure,
            }
            Path(args.json).write_text(json.dumps(results, indent=1))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--stand-in",
        action="store_true",
        help="one device as rank 0 of --config's world, measured beside its plan (verify/stand_in)",
    )
    parser.add_argument(
        "--rates",
        action="store_true",
        help="time --config's kernels at its step's shapes against the step-time model's ranges",
    )
    parser.add_argument(
        "--recipe", default="train_configs/llama3_8b_base.toml", help="the step's job"
    )
    parser.add_argument("--flavor", default="8B", help="the step's model (debugmodel on CPU)")
    parser.add_argument("--tokens-per-gpu", type=int, default=8192, help="the step's context / GPU")
    parser.add_argument("--no-step", dest="step", action="store_false", help="parity only")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    stand_in.add_arguments(parser)
    args, overrides = parser.parse_known_args(argv)
    if not (args.stand_in or args.rates):
        if overrides or args.config:
            parser.error(
                f"{overrides or ['--config']}: job files and overrides go with --stand-in/--rates"
            )
        return run_main(lambda: run(args), report_on_stdout=True)
    if args.stand_in and args.rates:
        parser.error("--stand-in and --rates are two runs: give one")
    if not args.config:
        parser.error(
            "--stand-in and --rates need --config RECIPE (and any --section.key overrides)"
        )
    for arg in overrides:
        if arg.startswith("-") and "." not in arg.split("=", 1)[0]:
            parser.error(f"unrecognized option {arg}; --section.key value overrides the job file")
    job = ["--config", args.config, *overrides]
    if args.rates:
        return run_main(
            lambda: kernel_rates.run(job, args.device, args.json), report_on_stdout=True
        )
    return run_main(
        lambda: stand_in.run(
            job,
            args.device,
            args.steps,
            args.world_size,
            args.plan,
            args.json,
            args.profile,
            args.cpu_minutes,
        ),
        report_on_stdout=True,
    )
