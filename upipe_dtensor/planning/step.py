"""Will this recipe fit? The recipe's real training step, run on fake tensors and tracked.

One CPU process plays rank 0 of the recipe's world: a fake process group of the recipe's size,
``FakeTensorMode`` (shapes and dtypes, no memory, no compute) and the project's real code: model
build, UPipe/Ulysses, FSDP2, checkpointing with host offload, tiled MLP, chunked loss, forward,
backward and the optimizer step. The custom ops run transparently (``kernels.op_mode``), so the
tracker sees the buffers inside UPipe's stage loop, the MLP tiles and the loss chunks.

Fake CPU tensors stand in for GPU memory and fake ``meta`` tensors for the host buffers of the
activation offload and FPDT's chunks. FSDP2 CPU offload (``[training] enable_cpu_offload``) is
modelled by moving the sharded float32 parameters, gradients and optimizer state from the device
to the host. What a CUDA run holds outside the step's tensors (CUDA context, NCCL buffers, cuBLAS
workspaces, allocator fragmentation) is added as documented allowances (``CudaAllowances``), and
flash-attn's backward workspace is allocated in the fake step where the kernel would allocate it.

A GPU plan also rehearses the CUDA job on the same step (``planning.rehearsal``): the
process-group backend it initialises (``runtime.process_group``, the trainer's own choice), every
collective by kind and by the device type of its tensors (a collective on a device type that
backend does not serve refuses the plan), and the host syncs of one step with their call sites.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from upipe_dtensor.config import ConfigError, JobConfig, check_job
from upipe_dtensor.config.schema import Parallelism
from upipe_dtensor.models.family import get_family
from upipe_dtensor.models.hf_config import model_args
from upipe_dtensor.modes.ops import computations_run_by, transparent_ops
from upipe_dtensor.modes.traces import forget_per_trace_caches
from upipe_dtensor.planning import compiled as planned_compile
from upipe_dtensor.planning.depth import DepthReduction, ElidedBlocks, reduce_depth
from upipe_dtensor.planning.hardware import GPU_PROFILES, HardwareProfile
from upipe_dtensor.planning.rehearsal import GpuRehearsal, RehearsalReport
from upipe_dtensor.planning.replay import ComputationReplay
from upipe_dtensor.planning.step_time import StepShape, StepTime, predict_step_time
from upipe_dtensor.planning.step_work import StepWork, StepWorkCounter, refuse_unpriced
from upipe_dtensor.planning.timeline import StepTimeline, expand
from upipe_dtensor.planning.tracker import EXPERTS, MODEL_STATES, LiveMemoryTracker, Peak
from upipe_dtensor.runtime.fake_process_group import init_fake_process_group
from upipe_dtensor.runtime.group_backends import backend_device_types
from upipe_dtensor.runtime.process_group import process_group_backend
from upipe_dtensor.runtime.torch_private import (
    FakeTensorMode,
    current_graph_task_id,
    unset_fake_temporarily,
)
from upipe_dtensor.train.build import Placement
from upipe_dtensor.train.parallelize import describe_cp_style
from upipe_dtensor.train.setup import build_meshes, holds_host_tensors
from upipe_dtensor.train.trainer import Trainer

GiB = 2**30
DEVICE, HOST = torch.device("cpu"), torch.device("meta")  # fake stand-ins for GPU and host RAM


@dataclass(frozen=True)
class CudaAllowances:
    """What a CUDA run holds on each GPU that the fake step cannot see, each a documented,
    deliberately generous allowance (no GPU has been available to measure them here):

    - ``context_bytes``: the CUDA context and the loaded kernel images of torch, NCCL and
      flash-attn. It is not in torch's allocator; with lazy module loading PyTorch measured 287 MB
      for torch's own (pytorch/pytorch#86509, nvidia-smi style: total minus free), and about
      400 MB is commonly reported (#109888); NCCL's and flash-attn's kernels add on first use.
      1 GiB.
    - ``nccl_bytes_per_communicator``: NCCL's buffers, per communicator this rank belongs to (the
      default group, the FSDP group and each CP axis; NCCL creates one per process group on first
      use), allocated by NCCL outside torch's allocator. NCCL's documented default is
      NCCL_BUFFSIZE = 4 MiB per channel and peer; measured: 544-688 MB per group on 4 x A100
      (NVIDIA/nccl#964), but an all-to-all on 8 x H100 grew NCCL's memory by 3.3 GB (32 channels
      per peer pair, NVIDIA/nccl#1685), so the head axis' communicator may need several times
      this. 0.5 GiB each, until ``gpu_check`` measures this code's.
    - ``cublas_workspace_bytes``: cuBLAS/cuBLASLt workspaces of the compute stream (torch's
      default CUBLAS_WORKSPACE_CONFIG on Hopper is 32 MiB, once per library), taken from torch's
      caching allocator (``CublasHandlePool.cpp``). 64 MiB.
    - ``fragmentation``: caching-allocator rounding (512-byte blocks, 2 MiB pages) and what
      expandable segments cannot hand back, as a fraction of the tracked peak (no published
      figure). 5%.

    ``Plan.allocator_peak_bytes`` leaves out the two that torch's allocator does not hold (the
    context and NCCL's buffers): that is the peak ``torch.cuda.max_memory_reserved`` reports.

    FlashAttention's backward workspace is not an allowance: the traced CUDA kernels allocate it
    in the fake step at the moment the CUDA kernel would
    (``kernels.traced_workspace.cuda_backward_workspace_bytes``).
    """

    context_bytes: int = GiB
    nccl_bytes_per_communicator: int = GiB // 2
    cublas_workspace_bytes: int = 64 * 2**20
    fragmentation: float = 0.05

    def rows(self, tracked_peak: int, communicators: int) -> dict[str, int]:
        return {
            CUDA_CONTEXT: self.context_bytes,
            f"{NCCL_BUFFERS} ({communicators} communicators)": communicators
            * self.nccl_bytes_per_communicator,
            CUBLAS_WORKSPACE: self.cublas_workspace_bytes,
            f"{FRAGMENTATION} ({self.fragmentation:.0%})": int(tracked_peak * self.fragmentation),
        }


CUDA_CONTEXT, NCCL_BUFFERS, CUBLAS_WORKSPACE = "CUDA context", "NCCL buffers", "cuBLAS workspace"
FRAGMENTATION = "allocator rounding and fragmentation"
FIXED_ALLOWANCES = (CUDA_CONTEXT, NCCL_BUFFERS, CUBLAS_WORKSPACE)
"""The allowances that do not grow with the sequence (fragmentation is a fraction of the peak)."""


def nccl_communicators(config: JobConfig, world_size: int) -> int:
    """Communicators one rank creates: the default group and FSDP's (more than one rank), the
    head all-to-all axis, the ring axis, the tensor-parallel group, and expert parallelism's
    ep group and its experts' FSDP group (each when it has more than one rank)."""
    parallelism = config.parallelism
    heads = parallelism.head_degree
    ring = parallelism.context_parallel_degree // heads
    tp, ep = parallelism.tensor_parallel_degree, parallelism.expert_parallel_degree
    experts = (ep > 1) + (ep > 1 and world_size // ep > 1)
    return 2 * (world_size > 1) + (heads > 1) + (ring > 1) + (tp > 1) + experts


@dataclass
class Budget:
    device_bytes: int = 80 * GiB
    """Memory per GPU."""
    host_bytes_per_node: int = 2048 * GiB
    """Host RAM per node."""
    gpus_per_node: int = 8
    gpu: str = "h100-sxm"
    """The GPU kind whose hardware profile prices the step (``hardware.GPU_PROFILES``)."""


@dataclass
class Plan:
    """Per-rank prediction for one job (all ranks of a CP job do the same work)."""

    config_file: str | None
    seq_len: int
    cp_style: str
    heads_per_stage: int
    attention: str
    """The CP attention in words (style, U, FPDT chunks, ring axis)."""
    traced_on: str
    """The device whose kernels the step ran: "cuda" when the CUDA kernels' branch was traced on
    fake tensors (a GPU plan), "cpu" for a CPU plan."""
    attention_backend: str
    """The attention backend traced ([parallelism] attention_backend resolved for that device)."""
    world_size: int
    device_peak_bytes: int
    device_peak_when: str
    device_breakdown: dict[str, int]
    host_peak_bytes: int
    host_per_node_bytes: int
    budget: Budget = field(default_factory=Budget)
    document_metadata_bytes: int = 0
    """Device bytes of the document options ([training] position_ids = 'document'): this rank's
    int64 positions, per micro-batch (the document ids live in host memory)."""
    speed: StepTime | None = None
    """The predicted step time on the plan's hardware profile (None: no profile given)."""
    compute_flops: float = 0.0
    """One rank's matmul and attention FLOPs in one step, as counted (``planning.step_work``),
    with or without a profile: a CPU stand-in run bounds its own time by it before it starts."""
    host_holds: str = "activation offload"
    """What the host memory holds, in words (FSDP CPU offload only when it is on)."""
    process_group_backend: str = ""
    """What a job of this config on the traced device passes to ``init_process_group``
    (``runtime.process_group``, the trainer's own choice)."""
    host_syncs_per_step: int | None = None
    """Host-device synchronisations of one step of the CUDA job (``planning.rehearsal``; None
    for a CPU plan, where host and device are one)."""
    host_syncs: list[dict] = field(default_factory=list)
    """Each kind of sync with its call site and count per step."""
    collectives: dict[str, int] = field(default_factory=dict)
    """Calls per step by kind and by the device type of their tensors, "all_reduce on cpu"."""
    compiled: bool = False
    """Compiled blocks, planned from inductor's graphs (``planning.compiled``)."""
    n_layers: int = 0
    """Blocks of the model planned."""
    traced_layers: int = 0
    """Blocks of the model the step was traced on (fewer than ``n_layers``: a reduced-depth
    trace standing for the full one, ``planning.depth``)."""
    experts_high_bytes: int = 0
    """A mixture of experts' own buffers (routing, permuted tokens, experts' hidden states) at
    their largest during the step, on the device: they peak inside an MoE block, rarely at the
    step's peak. 0 for a dense model."""
    expert_parallel_degree: int = 1
    """Ranks each MoE block's experts are split over; their token exchanges are planned for a
    router that spreads tokens evenly (``plan_job``), or for the busiest rank of a skewed one."""
    expert_load: float = 1.0
    """With expert parallelism: the planned rank's routed tokens as a multiple of its even share
    (1: even routing; ``plan_job``)."""

    @property
    def fits_device(self) -> bool:
        return self.device_peak_bytes <= self.budget.device_bytes

    @property
    def fits_host(self) -> bool:
        return self.host_per_node_bytes <= self.budget.host_bytes_per_node

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    @property
    def exceeds(self) -> str:
        """What does not fit, in words: "device memory", "host memory", both, or ""."""
        checks = (("device", self.fits_device), ("host", self.fits_host))
        over = [name for name, ok in checks if not ok]
        return f"{' and '.join(over)} memory" if over else ""

    @property
    def verdict(self) -> str:
        """The plan in words, "fits" or "does not fit (host memory)": every line that reports a
        plan says which memory does not fit."""
        return "fits" if self.fits else f"does not fit ({self.exceeds})"

    @property
    def tracked_peak_bytes(self) -> int:
        """The device peak of the step's tensors alone, without any CUDA allowance: what
        ``torch.cuda.max_memory_allocated`` measures."""
        return self.device_peak_bytes - self._rows_bytes((*FIXED_ALLOWANCES, FRAGMENTATION))

    @property
    def allocator_peak_bytes(self) -> int:
        """The device peak as torch's caching allocator holds it (``torch.cuda
        .max_memory_reserved``, the "memory" torchtitan's trainer logs): the step's tensors, the
        cuBLAS workspaces (torch allocates them) and the fragmentation allowance, without the
        CUDA context and NCCL's buffers, which live outside torch's allocator. Measured reserved
        peaks compare with this; the GPU's budget with ``device_peak_bytes``."""
        return self.device_peak_bytes - self._rows_bytes((CUDA_CONTEXT, NCCL_BUFFERS))

    def _rows_bytes(self, labels: tuple[str, ...]) -> int:
        """Bytes of the breakdown rows whose label starts with one of ``labels``."""
        return sum(n for label, n in self.device_breakdown.items() if label.startswith(labels))

    @property
    def device_fixed_bytes(self) -> int:
        """The part of the device peak that does not grow with the sequence: model states and
        CUDA's fixed allowances (a search that holds one plan extrapolates from the rest)."""
        return sum(
            nbytes
            for label, nbytes in self.device_breakdown.items()
            if label == MODEL_STATES or label.startswith(FIXED_ALLOWANCES)
        )

    def as_dict(self) -> dict:
        speed = self.speed
        return {
            **dataclasses.asdict(dataclasses.replace(self, speed=None)),
            "speed": speed.as_dict() if speed else None,
            "fits": self.fits,
            "fits_device": self.fits_device,
            "fits_host": self.fits_host,
            "exceeds": self.exceeds,
            "tracked_peak_bytes": self.tracked_peak_bytes,
            "allocator_peak_bytes": self.allocator_peak_bytes,
            "step_time_s": speed.step_time_s if speed else None,
            "tokens_per_s_per_gpu": speed.tokens_per_s_per_gpu if speed else None,
            "tokens_per_s_per_gpu_range": list(speed.tokens_per_s_per_gpu_range) if speed else None,
            "step_time_range_s": list(speed.step_time_range_s) if speed else None,
            "mfu": speed.mfu if speed else None,
            "time_breakdown_s": speed.time_breakdown_s if speed else None,
        }

    def render(self) -> str:
        budget = self.budget
        lines = [
            f"plan for {self.config_file}: seq_len {self.seq_len:,}, {self.attention}, "
            f"{self.world_size} ranks, {self.attention_backend} attention kernels traced on "
            f"{self.traced_on}, {'compiled' if self.compiled else 'eager'} blocks",
            f"  device peak per rank : {self.device_peak_bytes / GiB:8.2f} GiB of "
            f"{budget.device_bytes / GiB:g} GiB, at {self.device_peak_when}",
        ]
        if self.allocator_peak_bytes != self.device_peak_bytes:
            lines.append(
                f"  torch allocator peak : {self.allocator_peak_bytes / GiB:8.2f} GiB (what "
                "torch.cuda.max_memory_reserved reports: no CUDA context, no NCCL buffers)"
            )
        for label, nbytes in sorted(self.device_breakdown.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {label:<42s} {nbytes / GiB:8.2f} GiB")
        if self.experts_high_bytes:
            lines.append(
                f"  {EXPERTS:<20s} : {self.experts_high_bytes / GiB:8.2f} GiB at most, during "
                "an MoE block (router scores, permuted tokens, experts' hidden states)"
            )
        if self.expert_parallel_degree > 1:
            routing = (
                "evenly routed tokens (a skewed router sends some ranks more: --expert-load)"
                if self.expert_load == 1
                else f"the busiest rank, its experts receiving {self.expert_load:g}x their even "
                "share"
            )
            lines.append(
                f"  expert parallelism   : experts over {self.expert_parallel_degree} ranks, "
                f"token exchanges sized for {routing}"
            )
        lines += [
            f"  host per rank        : {self.host_peak_bytes / GiB:8.2f} GiB ({self.host_holds})",
            f"  host per node        : {self.host_per_node_bytes / GiB:8.2f} GiB of "
            f"{budget.host_bytes_per_node / GiB:g} GiB ({budget.gpus_per_node} GPUs per node)",
            *(
                [
                    f"  document metadata    : {self.document_metadata_bytes / 2**20:8.2f} MiB per "
                    "rank "
                    f"({self.document_metadata_bytes / max(self.device_peak_bytes, 1):.3%} of the "
                    "peak; "
                    f"ids of the whole sequence, positions of the shard)"
                ]
                if self.document_metadata_bytes
                else []
            ),
            f"  fits: {'yes' if self.fits else f'NO ({self.exceeds})'}",
            *self._render_rehearsal(),
            *(self.speed.render() if self.speed else []),
        ]
        return "\n".join(lines)

    def _render_rehearsal(self) -> list[str]:
        """The process group, the collectives and the host syncs of one step."""
        collectives = ", ".join(f"{kind} {n:,}" for kind, n in self.collectives.items())
        lines = [
            f"  process group        : {self.process_group_backend}"
            + (f" ({collectives})" if collectives else "")
        ]
        if self.host_syncs_per_step is not None:
            lines.append(f"  host syncs per step  : {self.host_syncs_per_step}")
            lines += [
                f"    {row['count']:>6,} x {row['what']} at {row['site']}"
                for row in self.host_syncs
            ]
        return lines


def _watch_progress(trainer: Trainer, tracker: LiveMemoryTracker) -> None:
    """Module hooks that tell the tracker where in the step it is (for 'when' and 'loss')."""
    model = trainer.model

    def entering(name: str):
        def hook(_module, _args):
            if torch.compiler.is_compiling():  # inside a compiled block: its wrapper tells
                return
            backward = current_graph_task_id() != -1
            tracker.when = f"{'backward (recompute)' if backward else 'forward'}, block {name}"
            tracker.in_head = False

        return hook

    def leaving(name: str):
        """A compiled block's wrapper: its backward starts when its output's gradient node runs
        (the recompute inside runs compiled, where no hook can tell)."""

        def hook(_module, _args, output):
            if torch.compiler.is_compiling() or output.grad_fn is None:
                return

            def backward_starts_here(_grads):
                tracker.when = f"backward (recompute), block {name}"
                tracker.in_head = False

            output.grad_fn.register_prehook(backward_starts_here)

        return hook

    def head(_module, _args):
        backward = current_graph_task_id() != -1
        tracker.when = f"{'backward' if backward else 'forward'}, output head and loss"
        tracker.in_head = True

    def backward_starts(_module, _grad_output):
        tracker.when = "backward, output head and loss"
        tracker.in_head = True

    for name, block in model.layers.items():
        # Recompute calls the module inside a checkpoint wrapper, not the wrapper itself.
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        inner.register_forward_pre_hook(entering(name))
        if inner is not block and getattr(inner, "_compiled_call_impl", None) is not None:
            block.register_forward_pre_hook(entering(name))
            block.register_forward_hook(leaving(name))
    model.norm.register_forward_pre_hook(head)
    model.norm.register_full_backward_pre_hook(backward_starts)
    trainer.optimizer.register_step_pre_hook(lambda *_: setattr(tracker, "when", "optimizer step"))


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _sharded_state_bytes(trainer: Trainer) -> int:
    """Bytes of this rank's parameter, gradient and optimizer-state shards (FSDP CPU offload)."""
    params = sum(_local_bytes(p) for p in trainer.model.parameters())
    optimizer = sum(
        _local_bytes(t)
        for state in trainer.optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    return 2 * params + optimizer  # gradients are as large as the parameters


def document_metadata_bytes(config: JobConfig) -> int:
    """What the document options add on each device: the (B, S/C) int64 positions of the shard
    ([training] position_ids = 'document'). The (B, S) int32 document ids of the whole sequence
    (every CP rank needs every boundary) stay in host memory (``ParallelModel.document_inputs``)."""
    training = config.training
    batch, seq_len = training.local_batch_size, training.seq_len
    positions = batch * seq_len // config.parallelism.context_parallel_degree * 8
    return positions if training.position_ids == "document" else 0


def tracked_step(
    trainer: Trainer,
    tracker: LiveMemoryTracker,
    config: JobConfig,
    counter: StepWorkCounter | None = None,
    rehearsal: GpuRehearsal | None = None,
    set_up: Callable[[], object] | None = None,
) -> None:
    """The measured step, the same for a plan and for a real run: the optimizer state is set up
    first (AdamW creates it lazily; one step on zero gradients), then one training step on a
    batch of token ids is tracked from its start (and its work counted by ``counter``, and
    rehearsed as a CUDA job's by ``rehearsal``, up to the optimizer step, which the time model
    charges per parameter). ``set_up`` runs last before the step (a reduced-depth plan's
    stand-ins for the blocks it does not trace, ``planning.depth``)."""
    _watch_progress(trainer, tracker)
    for param in trainer.model.parameters():
        param.grad = torch.zeros_like(param)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    if set_up is not None:
        set_up()
    tracker.start_step()
    watchers = [w for w in (counter, rehearsal) if w is not None]
    for watcher in watchers:
        watcher.counting = True

    def stop_counting(*_) -> None:
        for watcher in watchers:
            watcher.counting = False

    trainer.optimizer.register_step_pre_hook(stop_counting)
    training = config.training
    step = contextlib.nullcontext()
    if rehearsal is not None:
        if config.training.enable_cpu_offload:
            rehearsal.hold_offloaded_state(trainer.model)
        rehearsal.outside_compiled_blocks(trainer.model)
        step = rehearsal.step()
    with step:  # the loader's batch: host memory, as on a GPU job
        tokens = torch.zeros(training.local_batch_size, training.seq_len, dtype=torch.long)
        trainer.train_step([(tokens, tokens)] * training.gradient_accumulation_steps)


def refuse_missing_backends(report: RehearsalReport, backend: str, device_type: str) -> None:
    """ConfigError when a collective of the rehearsed step runs on tensors of a device type
    ``backend`` (the job's ``init_process_group`` string) has no backend for: the job would stop
    there with "No backend type associated with device type ..."."""
    covered = backend_device_types(backend)
    missing = [(kind, device) for kind, device in report.collectives if device not in covered]
    if missing:
        kind, device = missing[0]
        site = report.collective_sites[(kind, device)]
        raise ConfigError(
            f"a {device_type} job of this config runs {kind} on {device} tensors ({site}), but "
            f"its process group is initialised with {backend!r}, which has no {device} backend: "
            f"it would stop there with 'No backend type associated with device type {device}'. "
            f"process_group_backend (upipe_dtensor/runtime/process_group.py) must give {device} "
            "tensors a backend for this config, or the config must keep them off the host "
            "([training] enable_cpu_offload = false)"
        )


@dataclass
class TracedStep:
    """What tracing one step gives every plan of the same traced job (``plan_job``)."""

    work: StepWork
    """The counted work (of the traced model: ``expand`` adds the blocks not traced)."""
    unpriced: set[str]
    report: RehearsalReport | None
    peaks: dict[str, Peak]
    """Each device's peak (a full trace's; a reduced one's come from ``timeline``)."""
    timeline: StepTimeline | None
    moved_bytes: int
    """The sharded states FSDP CPU offload keeps in host memory (0 without it)."""
    shape: StepShape
    kernel_device: str
    attention_backend: str


class TraceCache:
    """Traced steps a search reuses, and how many it traced: a plan whose traced job (the
    reduced-depth model with its settings, its depth, world and target) was traced already is
    rebuilt from that trace. Plans that differ only in how many of the last blocks keep their
    attention trace the same reduced model (``planning.depth``)."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self.traces = 0
        """Steps traced (the plans rebuilt from an earlier trace are not counted)."""
        self._entries: list[tuple[tuple, TracedStep]] = []

    def get(self, key: tuple) -> TracedStep | None:
        for known, traced in self._entries:
            if known == key:
                return traced
        return None

    def put(self, key: tuple, traced: TracedStep) -> None:
        self.traces += 1
        self._entries = [*self._entries, (key, traced)][-self.size :]


def plan_job(
    config: JobConfig,
    budget: Budget | None = None,
    world_size: int | None = None,
    *,
    target: str = "cuda",
    allowances: CudaAllowances | None = None,
    profile: HardwareProfile | None = None,
    full_trace: bool = False,
    traces: TraceCache | None = None,
    expert_load: float = 1.0,
) -> Plan:
    """Run one fake training step of ``config`` as rank 0 and report its memory and, priced with
    a hardware ``profile``, its time (``planning.step_time``).

    ``target="cuda"`` models a GPU run (bf16 mixed precision, offloaded activations on the
    host, flash-attn's backward workspace, and the ``allowances`` for what CUDA holds outside
    the step), priced with the budget's GPU profile unless ``profile`` is given;
    ``target="cpu"`` models a CPU run (float32, host and device are one memory, no allowances;
    timed only with a given ``profile``, such as the measured one of
    ``benchmarks/cpu_profile.py``), which the tests compare with real CPU runs.

    With ``[compile] enable`` the blocks are compiled as in the real job, up to the graphs
    inductor lowers, and those graphs run on the fake tensors as inductor's code runs them
    (``planning.compiled``): the plan counts the compiled step's memory and its fused kernels.

    The step is traced on a reduced-depth model that stands for the full one
    (``planning.depth``, ``planning.timeline``: the same bytes, work and times);
    ``full_trace`` traces every block and runs every attention computation in full
    (``planning.replay``). ``traces``: a search's cache of traced steps.

    Expert parallelism is planned with its router spreading tokens evenly over the experts
    (``ModelFamily.balanced_routing``): the exchanges' sizes come from the routing, which a fake
    step does not have. ``expert_load`` > 1 plans the busiest rank instead, its experts
    receiving that many times their even share (the step waits for it; its memory is the most).
    """
    budget = budget or Budget()
    parallelism = config.parallelism
    world_size = world_size or parallelism.world_size
    check_job(config, world_size)
    reduction = None if full_trace else reduce_depth(config)
    traced_config = reduction.config if reduction is not None else config
    key = (
        dataclasses.replace(traced_config, config_file=None, sources={}, files=[]),
        reduction.n_layers if reduction is not None else 0,
        full_trace,
        world_size,
        target,
        budget.gpus_per_node,
        expert_load,
    )
    traced = traces.get(key) if traces is not None else None
    if traced is None:
        traced = _trace(
            traced_config,
            reduction,
            world_size,
            target,
            budget.gpus_per_node,
            replay=not full_trace,
            expert_load=expert_load,
        )
        if traces is not None:
            traces.put(key, traced)
    peaks, work, report = traced.peaks, traced.work, traced.report
    if reduction is not None:
        expanded = expand(traced.timeline, reduction)
        peaks, work, report = expanded.peaks, expanded.work, expanded.report
    peak = peaks[str(DEVICE)]
    breakdown = {label: nbytes for label, nbytes in peak.by_label.items() if nbytes > 0}
    device_peak = peak.bytes
    host_peak = peaks[str(HOST)].bytes if target == "cuda" and str(HOST) in peaks else 0
    if config.training.enable_cpu_offload:
        device_peak -= traced.moved_bytes
        breakdown[MODEL_STATES] = breakdown.get(MODEL_STATES, 0) - traced.moved_bytes
        host_peak += traced.moved_bytes
    if target == "cuda":
        extra = (allowances or CudaAllowances()).rows(
            device_peak, nccl_communicators(config, world_size)
        )
        breakdown.update(extra)
        device_peak += sum(extra.values())
    backend = process_group_backend(target, holds_host_tensors(config))
    rehearsed = report if report is not None else RehearsalReport()
    refuse_missing_backends(rehearsed, backend, target)
    ranks_per_node = min(world_size, budget.gpus_per_node)
    args = model_args(config.model, config.training.seq_len)
    n_heads = args.n_heads
    profile = profile or (GPU_PROFILES[budget.gpu] if target == "cuda" else None)
    speed = None
    if profile is not None:
        refuse_unpriced(traced.unpriced)
        speed = predict_step_time(work, traced.shape, profile)
    return Plan(
        config_file=config.config_file,
        compiled=config.compile.enable,
        seq_len=config.training.seq_len,
        cp_style=parallelism.cp_style,
        heads_per_stage=parallelism.stage_heads(n_heads),
        attention=describe_cp_style(parallelism, n_heads),
        traced_on=traced.kernel_device,
        attention_backend=traced.attention_backend,
        world_size=world_size,
        device_peak_bytes=device_peak,
        device_peak_when=peak.when,
        device_breakdown=breakdown,
        host_peak_bytes=host_peak,
        host_per_node_bytes=host_peak * ranks_per_node,
        budget=budget,
        document_metadata_bytes=document_metadata_bytes(config),
        speed=speed,
        compute_flops=work.matmul_flops + sum(work.attention_flops.values()),
        host_holds="activation offload"
        + (", FSDP CPU offload" if config.training.enable_cpu_offload else ""),
        process_group_backend=backend,
        host_syncs_per_step=rehearsed.host_syncs_per_step if report is not None else None,
        host_syncs=rehearsed.sync_rows(),
        collectives=rehearsed.collective_counts(),
        n_layers=args.n_layers,
        traced_layers=reduction.traced_layers if reduction is not None else args.n_layers,
        experts_high_bytes=peak.label_highs.get(EXPERTS, 0),
        expert_parallel_degree=parallelism.expert_parallel_degree,
        expert_load=expert_load if parallelism.expert_parallel_degree > 1 else 1.0,
    )


@contextlib.contextmanager
def _meshes_from_real_tensors() -> Iterator[None]:
    """Device meshes made inside the fake step from real tensors: FSDP2 joins its dp_shard x cp
    mesh with the tensor-parallel one for each DTensor parameter, and a mesh finds this rank's
    coordinates with ``nonzero``, which a fake tensor cannot answer (its mesh is host metadata,
    not a tensor of the step)."""
    init = DeviceMesh.__init__

    def real_init(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    DeviceMesh.__init__ = real_init
    try:
        yield
    finally:
        DeviceMesh.__init__ = init


def _trace(
    config: JobConfig,
    reduction: DepthReduction | None,
    world_size: int,
    target: str,
    gpus_per_node: int,
    *,
    replay: bool,
    expert_load: float = 1.0,
) -> TracedStep:
    """One fake step of ``config`` (the reduced-depth model of ``reduction``, with stand-ins for
    the blocks it does not trace), tracked, counted and rehearsed; ``replay``: attention
    computations alike an earlier one replayed (``planning.replay``)."""
    host = HOST if target == "cuda" else DEVICE
    parallelism = config.parallelism
    dp = check_job(config, world_size)
    compiled = config.compile.enable
    config = dataclasses.replace(  # compiled blocks: inductor's graphs, replayed (docstring)
        config,
        checkpoint=dataclasses.replace(config.checkpoint, enable=False),
        metrics=dataclasses.replace(  # no sink: nothing written, no dump folder claimed
            config.metrics, enable_tensorboard=False, enable_jsonl=False, enable_wandb=False
        ),
        compile=dataclasses.replace(config.compile, backend=planned_compile.PLANNER_BACKEND),
    )
    init_fake_process_group(world_size)
    forget_per_trace_caches()
    try:
        cp, ring = parallelism.context_parallel_degree, parallelism.ring_degree
        meshes = build_meshes(
            "cpu",
            dp,
            cp,
            ring,
            parallelism.tensor_parallel_degree,
            parallelism.expert_parallel_degree,
        )
        tracker = LiveMemoryTracker()
        tp_group = meshes.tp.get_group().group_name if meshes.tp.size() > 1 else ""
        counter = StepWorkCounter(DEVICE, host, gpus_per_node, tp_group)
        rehearsal = GpuRehearsal(DEVICE, host, target) if target == "cuda" else None
        watch = rehearsal.ops() if rehearsal is not None else contextlib.nullcontext()
        timeline = StepTimeline(counter, rehearsal) if reduction is not None else None
        replayed = (
            computations_run_by(ComputationReplay(tracker, counter, rehearsal))
            if replay
            else contextlib.nullcontext()
        )
        with (
            _routing(config, expert_load),
            planned_compile.fresh_compiles(compiled),
            _meshes_from_real_tensors(),
            FakeTensorMode(allow_non_fake_inputs=True),
            watch,
            transparent_ops(),
            tracker,
            counter,
            replayed,
        ):
            placement = Placement(
                meshes=meshes,
                device=DEVICE,
                host_device=host,
                mixed_precision=target == "cuda",
                kernel_device=target,
                n_layers=reduction.traced_layers if reduction is not None else None,
            )
            trainer = Trainer(config, placement=placement)
            set_up = None
            if reduction is not None:
                tracker.timeline = timeline
                set_up = functools.partial(
                    ElidedBlocks, trainer.model, trainer.optimizer, reduction, tracker
                )
            tracked_step(trainer, tracker, config, counter, rehearsal, set_up)
            if timeline is not None:
                timeline.end()
                tracker.timeline = None
        n_layers = trainer.model.model_args.n_layers
        if reduction is not None:
            n_layers = reduction.n_layers
        return TracedStep(
            work=counter.work,
            unpriced=counter.unpriced,
            report=rehearsal.report if rehearsal is not None else None,
            peaks=dict(tracker.peaks),
            timeline=timeline,
            moved_bytes=_sharded_state_bytes(trainer) if config.training.enable_cpu_offload else 0,
            shape=_step_shape(trainer, config, target, n_layers),
            kernel_device=trainer.setup.kernel_device,
            attention_backend=trainer.setup.attention_backend,
        )
    finally:
        forget_per_trace_caches()
        dist.destroy_process_group()


def _routing(config: JobConfig, expert_load: float) -> contextlib.AbstractContextManager:
    """The routing the step's expert-parallel exchanges are sized for (``plan_job``)."""
    if config.parallelism.expert_parallel_degree == 1:
        return contextlib.nullcontext()
    return get_family(config.model.name).balanced_routing(expert_load)


def _overlapped_stages(parallelism: Parallelism, n_heads: int) -> int:
    """Head stages per pass whose exchanges fly during the previous stage's attention (UPipe's
    ``overlap_stages`` without sequence chunks); 1 when every exchange is waited for at once."""
    if not parallelism.options.overlaps_stages:
        return 1
    return n_heads // parallelism.stage_heads(n_heads)


def _step_shape(trainer: Trainer, config: JobConfig, target: str, n_layers: int) -> StepShape:
    """What the time model needs of the job besides the counted work, for a model of
    ``n_layers`` blocks (the traced model holds stand-ins for those it does not trace)."""
    training, parallelism = config.training, config.parallelism
    model = trainer.model
    args = dataclasses.replace(model.model_args, n_layers=n_layers)
    # torchtitan's count: 6 N plus attention as the full square; causal attention is half of it.
    _, flops_per_token = args.get_nparams_and_flops(model, training.seq_len)
    _, dense_flops_per_token = args.get_nparams_and_flops(model, 0)
    return StepShape(
        backend=trainer.setup.attention_backend if target == "cuda" else "cpu",
        tokens_per_gpu=training.local_batch_size  # a tp group's GPUs share their cp shard
        * training.gradient_accumulation_steps
        * training.seq_len
        // (parallelism.context_parallel_degree * parallelism.tensor_parallel_degree),
        local_params=sum(_local_bytes(p) // p.element_size() for p in model.parameters()),
        optimizer_on_host=training.enable_cpu_offload,
        all_gathers_per_step=2 if parallelism.fsdp_reshard_after_forward else 1,
        block_inputs_prefetched=config.activation_checkpoint.cpu_offload_prefetch,
        overlapped_stages=_overlapped_stages(parallelism, args.n_heads),
        flops_per_token_causal=(flops_per_token + dense_flops_per_token) / 2,
        flops_per_token_torchtitan=flops_per_token,
    )
