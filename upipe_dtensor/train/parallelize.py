"""Apply the parallelisms and the memory stack to a model in a fixed order:
tiled MLP and RMSNorm -> tensor parallelism -> CP style -> compile (each block) -> activation
checkpointing + host offload -> FSDP2.

torchtitan checkpoints before compiling; here compile goes inside the checkpoint wrapper because
the offload's saved-tensor hooks cannot live inside a fullgraph-compiled region.

The mesh is (dp_shard, cp_ring, cp_heads, tp) with tensor parallelism innermost, then the head
axis (the ranks that exchange heads are neighbours, i.e. one node's NVLink domain; the ring axis
of 2D context parallelism crosses nodes). FSDP2 shards parameters over dp_shard x cp together, as
in the UPipe paper: the CP ranks hold the same parameters, so sharding over them too divides
parameter, gradient and optimizer memory by dp x cp (and tensor parallelism by tp again).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from upipe_dtensor.config import JobConfig
from upipe_dtensor.config.schema import Parallelism
from upipe_dtensor.kernels.fused import use_backend as use_fused_backend
from upipe_dtensor.kernels.inductor import register_inductor_fallbacks
from upipe_dtensor.memory.compiled_regions import compile_block
from upipe_dtensor.memory.kept_attention import KeptAttention
from upipe_dtensor.memory.offload import HostOffload, apply_activation_checkpointing
from upipe_dtensor.memory.rms_norm import apply_tiled_rms_norm
from upipe_dtensor.memory.tiled_mlp import apply_tiled_mlp
from upipe_dtensor.models import family_of
from upipe_dtensor.models.long_context import ForwardPlan
from upipe_dtensor.models.tensor_parallel import apply_tensor_parallel
from upipe_dtensor.parallel import ContextParallelAttention
from upipe_dtensor.parallel.registry import make_style
from upipe_dtensor.parallel.style_options import Geometry
from upipe_dtensor.train.setup import JobSetup

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class Parallelized:
    """What ``parallelize_llama`` set up that the caller needs afterwards."""

    cp_style: ContextParallelAttention
    """The context-parallel style: its ``shard_positions`` lays out every sequence."""
    host_offload: HostOffload | None
    """The activation offload (for its host-memory report), if on."""
    forward_plan: ForwardPlan
    """How every forward runs the model: the chunked loss, the checkpoint groups and the style's
    RoPE shard (the job passes it; the model holds none of it)."""


def kept_attention(setup: JobSetup) -> KeptAttention | None:
    """Where attention waits for the recompute (``[activation_checkpoint] keep_attention``)."""
    where = setup.config.activation_checkpoint.keep_attention
    return None if where == "none" else KeptAttention(where, setup.host_device)


def make_cp_style(
    setup: JobSetup, keep_attention: KeptAttention | None
) -> ContextParallelAttention:
    """The configured context-parallel style (``[parallelism] cp_style`` and its options), made
    by the registry for the job's model and mesh (so its layout is known at once) with the
    resolved attention backend and the device its kernels are chosen for."""
    config = setup.config
    parallelism = config.parallelism
    return make_style(
        {"cp_style": parallelism.cp_style, **parallelism.style_options},
        Geometry(
            n_heads=setup.args.n_heads,
            n_kv_heads=setup.args.n_kv_heads or setup.args.n_heads,
            cp_degree=parallelism.context_parallel_degree,
            ring_degree=parallelism.ring_degree,
            seq_len=config.training.seq_len,
            tp_degree=setup.tp,
        ),
        backend=setup.attention_backend,
        kernel_device=setup.kernel_device,
        keep_attention=keep_attention,
        host_device=setup.host_device,
    )


def describe_cp_style(parallelism: Parallelism, n_heads: int) -> str:
    """The configured attention in words, for start-up lines and plans."""
    cp, ring = parallelism.context_parallel_degree, parallelism.ring_degree
    return parallelism.style.describe(parallelism.options, n_heads, cp, ring)


def keeps_attention(config: JobConfig, index: int) -> bool:
    """Whether block ``index`` keeps its attention for backward's recompute
    ([activation_checkpoint] keep_attention, from block keep_attention_skip_first on)."""
    ac = config.activation_checkpoint
    return ac.keep_attention != "none" and index >= ac.keep_attention_skip_first


def reshards_after_forward(config: JobConfig, index: int, n_blocks: int) -> bool:
    """Whether FSDP2 frees block ``index``'s gathered parameters after its forward: not the last
    block's, which backward needs again right away."""
    return config.parallelism.fsdp_reshard_after_forward and index < n_blocks - 1


def apply_context_parallel(model: nn.Module, setup: JobSetup) -> ContextParallelAttention:
    """Apply the configured CP style to every attention module; returns the style, whose
    ``shard_positions`` says which tokens each CP rank feeds. 2D (ring_degree > 1) styles get the
    (cp_ring, cp_heads) mesh, the others the flattened cp mesh. With kept attention the first
    ``keep_attention_skip_first`` blocks get the same style without it."""
    kept = kept_attention(setup)
    style = make_cp_style(setup, kept)
    plan: dict[str, ParallelStyle] = {"layers.*.attention": style}
    config = setup.config
    if kept is not None and config.activation_checkpoint.keep_attention_skip_first:
        recomputed = make_cp_style(setup, None)
        plan = {
            f"layers.{name}.attention": style if keeps_attention(config, index) else recomputed
            for index, name in enumerate(model.layers.keys())
        }
    meshes = setup.meshes
    mesh = meshes.cp_2d if setup.config.parallelism.ring_degree > 1 else meshes.cp
    parallelize_module(model, mesh, plan)
    return style


def apply_compile(model: nn.Module, config: JobConfig) -> None:
    """Compile each block in place (keeps parameter names, so checkpoints do not change).

    Every block shares one compiled graph (per distinct block: kept attention or not): the
    blocks' forwards are classes, not per-block patched functions, so dynamo guards pass for
    each block after the first (``memory.tiled_mlp``). Shapes are static
    (``dynamic=False``): a training job has one, and the styles' layout arithmetic is plain
    Python on the sequence length. Where torch's engine holds a compiled backward's gradients
    until it returns (torch 2.11), a block compiles as two regions, so it keeps the tensors it
    keeps on 2.13 (``memory.compiled_regions``)."""
    if config.compile.backend == "inductor":
        register_inductor_fallbacks()
    exchanges_tokens = config.parallelism.expert_parallel_degree > 1
    for block in model.layers.values():
        compile_block(block, config.compile.backend, eager_mlp=exchanges_tokens)


def compile_report(backend: str) -> str:
    """What compiling cost this process so far, for the log after the first step: dynamo's graphs
    (one per distinct block, which every such block runs, and the tiled ops' fused kernels) and
    the wall time of compiling them, forward and backward (dynamo's own accounting)."""
    from upipe_dtensor.runtime.torch_private import calculate_time_spent, counters

    graphs = counters["stats"]["unique_graphs"]
    seconds = calculate_time_spent().get("total_wall_time", 0.0)
    return (
        f"compiled {graphs} graph{'s' * (graphs != 1)} ({backend}: blocks and tile kernels, "
        f"forward and backward) in {seconds:.1f} s"
    )


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    config: JobConfig,
    device: torch.device,
    mixed_precision: bool,
    experts: list[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """FSDP2 over ``mesh`` (dp_shard x cp): each block, the head, the rest. Expert-parallel
    ``experts`` are sharded first over ``expert_mesh`` (the ranks outside their ep group), with
    their gradients divided by all of dp_shard x cp as every other weight's: each rank's holds
    the tokens of its whole ep group, so their sum over ``expert_mesh`` is over every token.

    Note: FSDP2 divides by a factor other than its group's size with NCCL's PREMUL_SUM, which
    gloo lacks; there it sums and divides after (not on one rank: torch 2.13 divides twice)."""
    training = config.training
    if mixed_precision:
        # No cast of the units' floating inputs: the blocks' activations already arrive in the
        # compute dtype (the embedding's weight is), and the RoPE frequencies (float64) or the
        # shard's RoPE table (float32) they also receive must not be rounded to bf16 (at
        # position 10^6 a bf16 frequency's rounding moves the angle by thousands of radians).
        mp_policy = MixedPrecisionPolicy(
            param_dtype=DTYPES[training.mixed_precision_param],
            reduce_dtype=DTYPES[training.mixed_precision_reduce],
            cast_forward_inputs=False,
        )
    else:  # CPU kernels are not faster in bf16, and float32 keeps CPU runs exact
        mp_policy = MixedPrecisionPolicy()
    offload = (
        CPUOffloadPolicy(pin_memory=device.type == "cuda") if training.enable_cpu_offload else None
    )
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=mp_policy, offload_policy=offload)
    for module in experts:
        fully_shard(module, mesh=expert_mesh, mp_policy=mp_policy, offload_policy=offload)
        module.set_gradient_divide_factor(float(mesh.size()))
        if expert_mesh.size() > 1 and "gloo" in dist.get_backend(expert_mesh.get_group()):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (note)
    blocks = list(model.layers.values())
    for index, block in enumerate(blocks):
        shard(block, reshard_after_forward=reshards_after_forward(config, index, len(blocks)))
    # The head as its own unit (as torchtitan does): its gradients, the output layer's above all
    # (V x D), are reduce-scattered as soon as the loss's backward is done, not at the very end.
    # It is gathered at the final norm's forward, before the loss reads the output weight.
    shard([model.norm, model.output], reshard_after_forward=False)
    shard(model, reshard_after_forward=False)


def parallelize_llama(model: nn.Module, setup: JobSetup) -> Parallelized:
    """Apply everything the job's config asks for, on the devices and meshes of ``setup``;
    returns the CP style and the host offload.

    ``setup.mixed_precision`` applies [training] mixed_precision_param/reduce (on CUDA; the
    planner turns it on to model a GPU run with CPU stand-in tensors, see
    ``train.build.Placement``).
    """
    config, device, host_device = setup.config, setup.device, setup.host_device
    if config.memory.tiled_mlp:
        apply_tiled_mlp(model, config.memory.mlp_tile_tokens)
    if config.memory.tiled_rms_norm:
        apply_tiled_rms_norm(model, config.memory.norm_tile_tokens)
    if setup.tp > 1:  # the tiled MLP gathers its own input (``models.tensor_parallel``)
        apply_tensor_parallel(model, setup.meshes.tp, logits=False)
    cp_style = apply_context_parallel(model, setup)
    expert_meshes, experts = setup.meshes.experts, []
    if expert_meshes is not None:
        experts = family_of(setup.args).expert_parallel(model, expert_meshes)
    compiled = config.compile
    use_fused_backend(compiled.backend if compiled.enable and compiled.fuse_tiles else None)
    if compiled.enable:
        apply_compile(model, config)
    ac = config.activation_checkpoint
    offload = (
        HostOffload(device, host_device, prefetch=ac.cpu_offload_prefetch)
        if ac.cpu_offload
        else None
    )
    groups = ()
    if ac.mode == "full":
        groups = apply_activation_checkpointing(
            model,
            offload=offload,
            offload_skip_last=ac.cpu_offload_skip_last,
            blocks_per_checkpoint=ac.blocks_per_checkpoint,
        )
        if cp_style.kept is not None:  # a group's inner blocks recompute twice in backward
            for group in groups:
                for name in group.names[:-1]:
                    block = model.layers[name]
                    block = getattr(block, "_checkpoint_wrapped_module", block)
                    cp_style.kept.expect_recomputes(block.attention, 2)
    apply_fsdp(
        model,
        setup.meshes.fsdp,
        config,
        device,
        setup.mixed_precision,
        experts=experts,
        expert_mesh=expert_meshes["efsdp"] if expert_meshes is not None else None,
    )
    forward_plan = ForwardPlan(
        loss_chunk_tokens=config.memory.loss_chunk_tokens if config.memory.chunked_loss else 0,
        checkpoint_groups=groups,
        shard_rope=cp_style.shard_rope,  # the RoPE table once per forward, read by every layer
    )
    return Parallelized(cp_style=cp_style, host_offload=offload, forward_plan=forward_plan)
