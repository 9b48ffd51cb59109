"""A user's first GPU run: every style against the unsharded model, and one step of the 8B shape.

    torchrun --nproc_per_node N -m upipe_dtensor.gpu_check        # N from 1 to 8, one node

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
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import Transformer

from upipe_dtensor.config import ConfigError, parse_args
from upipe_dtensor.kernels.backends import BACKENDS, activate_backend, resolve_backend
from upipe_dtensor.parallel import (
    ContextParallelAttention,
    FPDTAttention,
    RingAttention,
    UlyssesAttention,
    UPipeAttention,
)
from upipe_dtensor.planning.step import Budget, Plan, plan_job
from upipe_dtensor.runtime.errors import run_main
from upipe_dtensor.runtime.parity import (
    cast_parameters,
    gather_sequence,
    rel_err,
    shard,
    summed_grads,
    worst_grad_err,
)

GiB = 2**30
HEADS, KV_HEADS, HEAD_DIM, VOCAB = 8, 4, 64, 256


@dataclass
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
    """The backends that run here, and why each other one does not."""
    working, skipped = [], {}
    for name in BACKENDS:
        if name == "auto":
            continue
        try:
            resolve_backend(name, device_type)
            working.append(name)
        except ValueError as err:
            skipped[name] = str(err)
    return working, skipped


def _styles(cp: int, seq_len: int, backend: str, device_type: str) -> dict[str, object]:
    kernels = {"backend": backend, "kernel_device": device_type}
    styles: dict[str, ContextParallelAttention] = {
        "UPipe (U = C)": UPipeAttention(**kernels),
        "Ulysses": UlyssesAttention(**kernels),
        "ring": RingAttention(**kernels),
        "FPDT (4 chunks)": FPDTAttention(chunk_tokens=seq_len // 4, **kernels),
        "UPipe x FPDT (4 chunks)": UPipeAttention(chunk_tokens=seq_len // 4, **kernels),
    }
    if cp >= 4 and cp == dist.get_world_size():  # 2D takes the whole world as its CP group
        styles["2D UPipe (2 x C/2)"] = UPipeAttention(ring_degree=2, **kernels)
    return styles


def _small_model(seq_len: int, device: torch.device) -> Transformer:
    args = TransformerModelArgs(
        dim=HEADS * HEAD_DIM, n_layers=2, n_heads=HEADS, n_kv_heads=KV_HEADS,
        vocab_size=VOCAB, max_seq_len=seq_len, rope_theta=500000.0,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


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


def check_parity(mesh: DeviceMesh, device: torch.device, backends: list[str]) -> list[ParityRow]:
    """Every style with every backend against the float64 unsharded model (module docstring)."""
    cp = mesh.size()
    seq_len = 512 * cp
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (1, seq_len + 1), generator=generator).to(device)
    tokens, labels = tokens[:, :-1], tokens[:, 1:]
    exact = _small_model(seq_len, device)
    cast_parameters(exact, torch.float64)
    exact_logits, exact_grads = _loss_and_grads(exact, tokens, labels, seq_len)
    rows = []
    for backend in backends:
        if device.type == "cuda":
            activate_backend(backend)  # FA3/FA4 take over aten's flash ops process-wide
        plain = _small_model(seq_len, device)
        cast_parameters(plain, torch.bfloat16)
        plain_logits, plain_grads = _loss_and_grads(plain, tokens, labels, seq_len)
        reference = (rel_err(plain_logits, exact_logits), worst_grad_err(plain_grads, exact_grads))
        for name, style in _styles(cp, seq_len, backend, device.type).items():
            model = _small_model(seq_len, device)
            cast_parameters(model, torch.bfloat16)
            style_mesh = mesh
            if getattr(style, "ring_degree", 1) == 2:
                names = ("cp_ring", "cp_heads")
                style_mesh = init_device_mesh(device.type, (2, cp // 2), mesh_dim_names=names)
            parallelize_module(model, style_mesh, {"layers.*.attention": style})
            logits, grads = _loss_and_grads(model, tokens, labels, seq_len, style, mesh)
            rows.append(
                ParityRow(
                    name, backend, rel_err(logits, exact_logits),
                    worst_grad_err(grads, exact_grads), *reference,
                )
            )  # fmt: skip
    return rows


@dataclass
class StepRow:
    job: str
    tokens_per_s_per_gpu: float
    allocated_gib: float
    reserved_gib: float
    planned_tracked_gib: float
    planned_total_gib: float


def _step_config(args: argparse.Namespace, world: int, dump: str, offload: bool):
    cp = cp_degree(world)
    return parse_args([
        "--config", args.recipe,
        "--model.flavor", args.flavor,
        "--training.seq_len", str(args.tokens_per_gpu * cp),
        "--training.enable_cpu_offload", str(offload).lower(),
        "--parallelism.context_parallel_degree", str(cp),
        "--parallelism.heads_per_stage", "0",
        "--checkpoint.enable", "false",
        "--metrics.enable_tensorboard", "false",
        "--job.dump_folder", dump,
        "--job.device", args.device,
    ])  # fmt: skip


def plan_step(args: argparse.Namespace, world: int, dump: str) -> tuple[object, Plan]:
    """The planner's prediction for the step, before any real process group exists; FSDP CPU
    offload is turned on when the plan does not fit without it."""
    budget = Budget(device_bytes=_device_bytes(args.device))
    for offload in (False, True):
        config = _step_config(args, world, dump, offload)
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
    from upipe_dtensor.jobs.trainer import Trainer  # the trainer pulls in the data pipeline

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
        job=f"{config.model.flavor}, {seq_len:,} tokens, {plan.attention}"
        + (", FSDP CPU offload" if config.training.enable_cpu_offload else ""),
        tokens_per_s_per_gpu=seq_len / seconds / trainer.setup.cp,
        allocated_gib=(torch.cuda.max_memory_allocated() if cuda else 0) / GiB,
        reserved_gib=(torch.cuda.max_memory_reserved() if cuda else 0) / GiB,
        planned_tracked_gib=plan.tracked_peak_bytes / GiB,
        planned_total_gib=plan.device_peak_bytes / GiB,
    )


def render(world: int, device: str, parity, skipped, step: StepRow | None) -> str:
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    lines = [
        f"### upipe-dtensor gpu_check: {world} x {name}, torch {torch.__version__}",
        "",
        "| style | backend | logits err | grad err | unsharded bf16 logits / grad err | ratio |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in parity:
        lines.append(
            f"| {r.style} | {r.backend} | {r.logits_err:.2e} | {r.grad_err:.2e} | "
            f"{r.reference_logits_err:.2e} / {r.reference_grad_err:.2e} | {r.ratio:.2f} |"
        )
    lines += [f"| (skipped) | {b} | {why} | | | |" for b, why in skipped.items()]
    if step is not None:
        lines += [
            "",
            "| step | tokens/s/GPU | allocated GiB | reserved GiB | planned (tracked) GiB "
            "| planned (with CUDA allowances) GiB |",
            "|---|---:|---:|---:|---:|---:|",
            f"| {step.job} | {step.tokens_per_s_per_gpu:,.0f} | "
            + (
                f"{step.allocated_gib:.2f} | {step.reserved_gib:.2f}"
                if device == "cuda"
                else "n/a | n/a"
            )
            + f" | {step.planned_tracked_gib:.2f} | {step.planned_total_gib:.2f} |",
        ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if "RANK" not in os.environ:
        raise ConfigError("gpu_check runs under torchrun: torchrun --nproc_per_node N -m ...")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("gpu_check needs CUDA here; --device cpu runs the same code on CPUs")
    dump = tempfile.mkdtemp(prefix="gpu_check-")
    planned = plan_step(args, world, dump) if args.step and rank == 0 else None  # no group yet
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
    if args.device == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    backends, skipped = available_backends(args.device)
    cp = cp_degree(world)
    mesh = init_device_mesh(args.device, (world // cp, cp), mesh_dim_names=("dp", "cp"))["cp"]
    parity = check_parity(mesh, device, backends)
    step = None
    if args.step:
        shared = [planned]  # rank 0's (config, plan) to every rank
        dist.broadcast_object_list(shared)
        step = measure_step(*shared[0])
    if rank == 0:
        print(render(world, args.device, parity, skipped, step), flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--recipe", default="train_configs/llama3_8b_base.toml", help="the step's job"
    )
    parser.add_argument("--flavor", default="8B", help="the step's model (debugmodel on CPU)")
    parser.add_argument("--tokens-per-gpu", type=int, default=8192, help="the step's context / GPU")
    parser.add_argument("--no-step", dest="step", action="store_false", help="parity only")
    args = parser.parse_args(argv)
    return run_main(lambda: run(args))
