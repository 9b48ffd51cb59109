"""The one path that turns a job config into a parallelised model on its device.

``train.py`` (through ``Trainer``), ``evaluate`` and ``convert`` all build their model here, so a
model evaluated or exported is laid out, sharded and loaded exactly as the one trained: the job is
checked, the process group and the (dp_shard, cp) meshes are set up, the model is built on the
meta device, the CP style, memory stack and FSDP2 are applied, and only then is this rank's shard
materialised (never the whole model on one rank).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from upipe_dtensor.checkpointing.weights import load_dcp_weights, load_hf_weights
from upipe_dtensor.config import ConfigError, JobConfig, check_job
from upipe_dtensor.config.checks import initial_load_folder
from upipe_dtensor.data.documents import document_ids, document_positions
from upipe_dtensor.data.loader import Tokenizer, job_tokenizer
from upipe_dtensor.kernels.backends import Choice, activate_backend, choose_backend
from upipe_dtensor.memory.offload import HostOffload
from upipe_dtensor.models import ForwardPlan, LongContextModel, family_of, init_sharded_weights
from upipe_dtensor.models.hf_config import ModelArgs, model_args
from upipe_dtensor.parallel import ContextParallelAttention
from upipe_dtensor.runtime.host_store import to_device
from upipe_dtensor.runtime.process_group import process_group_backend
from upipe_dtensor.train.parallelize import DTYPES, parallelize_llama
from upipe_dtensor.train.setup import JobSetup, Placement, build_meshes, holds_host_tensors


def pick_device(config: JobConfig) -> torch.device:
    """This process's device as [job] device asks: its CUDA device under torchrun ("cuda", or
    "auto" when CUDA works), else the CPU. "cuda" without a usable GPU is a ConfigError here,
    before any process group: a GPU job must not quietly train on the CPU."""
    requested = config.job.device
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU-only build)"
        raise ConfigError(
            f"{config.source_of('job.device')}: [job] device = 'cuda', but CUDA is not usable "
            f"here (torch {torch.__version__}, CUDA build {built}, {torch.cuda.device_count()} "
            "devices visible); fix the driver or CUDA_VISIBLE_DEVICES, install a CUDA build of "
            "torch, or set device = 'cpu'"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def resolve_attention(
    config: JobConfig, args: ModelArgs, kernel_device: str, traced: bool
) -> Choice:
    """[parallelism] attention_backend resolved for the device its kernels run on, the job's
    document masks, head_dim and compute dtype (ConfigError, before any process group)."""
    keys = ("parallelism.attention_backend", "job.device", "training.mixed_precision_param")
    head_dim = args.resolved_head_dim
    dtype = DTYPES[config.training.mixed_precision_param] if kernel_device == "cuda" else None
    try:
        return choose_backend(
            config.parallelism.attention_backend,
            kernel_device,
            traced=traced,
            documents=config.training.attention_mask == "document",
            head_dim=head_dim,
            dtype=dtype,
        )
    except ValueError as err:
        raise ConfigError(f"{config.source_of(*keys)}: [parallelism] {err}") from err


def configure_allocator(config: JobConfig) -> None:
    """[memory] expandable_segments for CUDA's caching allocator, which reads its settings at
    the first CUDA allocation: call before any (the kernel probes allocate). A user's own
    PYTORCH_CUDA_ALLOC_CONF wins."""
    if config.memory.expandable_segments:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def _init_process_group(backend: str) -> None:
    """torchrun's process group with ``backend`` (``runtime.process_group``: NCCL, and gloo for
    host tensors); a plain ``python`` run (no RANK in the environment) is a one-process group on
    a free local port, so evaluate and convert need no launcher for cp = 1."""
    if "RANK" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend)


PADDING_ROWS = 1024
"""Embedding rows a model may hold beyond its tokenizer's tokens: padding to a size the GPU likes
(Qwen3: 151,936 rows for its 151,669 tokens; Llama 3: none). More unused rows mean another
model's tokenizer: the 2,048-token stand-in with Llama3-8B left 126,208 rows untrained."""


def check_tokenizer_fits(
    config: JobConfig, tokenizer: Tokenizer, args: ModelArgs, *, exact: bool
) -> None:
    """ConfigError naming [model] tokenizer_path when the tokenizer's ids run past the model's
    embedding rows (any job: they would index out of range), or, with ``exact``, when the model
    has more rows than padding beyond them: another model's tokenizer. ``exact`` is for the jobs
    that tokenize text for this model or ship its tokenizer (train.py, ``convert --to hf``); the
    planner, gpu_check and the tests' builds feed token ids of their own."""
    tokens, rows = tokenizer.vocab_size, args.vocab_size
    if tokens <= rows and (not exact or rows - tokens < PADDING_ROWS):
        return
    model = f"{config.model.name} {config.model.flavor}"
    problem = (
        f"more than the {rows:,} embedding rows of {model}: ids from {rows:,} on have none"
        if tokens > rows
        else f"but {model} has {rows:,} embedding rows: {rows - tokens:,} would never be trained "
        f"(padding is under {PADDING_ROWS:,})"
    )
    where = config.source_of("model.tokenizer_path", "model.hf_assets_path", "model.flavor")
    raise ConfigError(
        f"{where}: [model] tokenizer_path: the tokenizer at {config.model.tokenizer_folder!r} has "
        f"{tokens:,} tokens, {problem}. Point [model] tokenizer_path at the model's own "
        "tokenizer (its Hugging Face folder holds tokenizer.json), or set [model] hf_assets_path "
        "to that folder and tokenizer_path = ''; the shipped assets/tokenizer is the debug "
        "models' 2,048-token stand-in"
    )


def set_up_job(
    config: JobConfig, placement: Placement = Placement(), *, exact_tokenizer: bool = False
) -> JobSetup:
    """Check ``config`` and the tokenizer (``ConfigError``, before any process group; with
    ``exact_tokenizer`` the tokenizer must be the model's own, ``check_tokenizer_fits``), then set
    up the process group and the (dp_shard, cp) meshes, as ``placement`` says."""
    world_size = (
        dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    )
    dp = check_job(config, world_size)  # before any process group or allocation
    args = model_args(config.model, config.training.seq_len)
    if placement.n_layers is not None:
        args = dataclasses.replace(args, n_layers=placement.n_layers)
    tokenizer = job_tokenizer(config)
    check_tokenizer_fits(config, tokenizer, args, exact=exact_tokenizer)
    configure_allocator(config)
    device = placement.device or pick_device(config)
    kernel_device = placement.kernel_device or device.type
    traced = placement.kernel_device is not None
    choice = resolve_attention(config, args, kernel_device, traced=traced)
    if kernel_device == "cuda" and not traced:
        activate_backend(choice.backend)
    if placement.device is None and not dist.is_initialized():
        _init_process_group(process_group_backend(device.type, holds_host_tensors(config)))
    parallelism = config.parallelism
    meshes = placement.meshes or build_meshes(
        device.type,
        dp,
        parallelism.context_parallel_degree,
        parallelism.ring_degree,
        parallelism.tensor_parallel_degree,
        parallelism.expert_parallel_degree,
    )
    mixed_precision = placement.mixed_precision
    return JobSetup(
        config=config,
        args=args,
        tokenizer=tokenizer,
        device=device,
        host_device=placement.host_device,
        mixed_precision=device.type == "cuda" if mixed_precision is None else mixed_precision,
        kernel_device=kernel_device,
        attention_backend=choice.backend,
        attention_choice=choice.describe(),
        meshes=meshes,
        world_size=world_size,
        dp=dp,
        dp_rank=meshes.dp_shard.get_local_rank(),
        cp=parallelism.context_parallel_degree,
        cp_rank=meshes.cp.get_local_rank(),
        tp=parallelism.tensor_parallel_degree,
        tp_rank=meshes.tp.get_local_rank(),
    )


@dataclass(frozen=True)
class ParallelModel:
    """A built, parallelised model, the job setup it was built on, and what its users need to
    feed it."""

    setup: JobSetup
    model: LongContextModel
    cp_style: ContextParallelAttention
    """Its ``shard_positions`` says which tokens of a sequence this CP rank feeds."""
    host_offload: HostOffload | None
    forward_plan: ForwardPlan
    """How the job runs the model's forward (chunked loss, checkpoint groups, RoPE shard)."""

    def __call__(self, tokens: Tensor, **kwargs) -> Tensor:
        """The model's forward under the job's plan: ``model(tokens, **kwargs)`` with the loss
        chunks, checkpoint groups and RoPE shard the config asks for. Calling ``model``
        directly runs the plain forward (whole logits, no groups), which is exact but not the
        job's memory."""
        return self.model(tokens, plan=self.forward_plan, **kwargs)

    def shard_sequence(self, batch: Tensor) -> Tensor:
        """This CP rank's tokens of every sequence (dim 1), in the order its CP style expects."""
        setup = self.setup
        positions = self.cp_style.shard_positions(batch.shape[1], setup.cp_rank, setup.cp)
        shard = batch.index_select(1, positions.to(batch.device))
        return to_device(shard, setup.device)  # pinned and non_blocking on CUDA

    def document_inputs(self, tokens: Tensor) -> dict[str, Tensor | None]:
        """The model's ``attention_masks`` and ``positions`` for a batch of whole sequences,
        as [training] attention_mask and position_ids ask (None: causal, global positions).

        The document ids cover the whole (B, S) sequence: every CP rank builds the whole batch
        from the loader, so no communication is needed; they cost 4 bytes per token. They stay
        in host memory: the attention kernels read the boundaries as host metadata (no device
        sync per block), and only each varlen block's cu_seqlens, a few integers, travel.
        """
        training = self.setup.config.training
        causal = training.attention_mask == "causal" and training.position_ids == "global"
        if causal:
            return {"attention_masks": None, "positions": None}
        doc_ids = document_ids(tokens, self.setup.tokenizer.eos_id)
        return {
            "attention_masks": doc_ids.to(self.setup.host_device)
            if training.attention_mask == "document"
            else None,
            "positions": self.shard_sequence(document_positions(doc_ids))
            if training.position_ids == "document"
            else None,
        }


def build_parallel_model(config: JobConfig, setup: JobSetup | None = None) -> ParallelModel:
    """Check ``config``, set up the process group and meshes (unless ``setup``, the result of
    ``set_up_job``, is given), build and parallelise the model, and fill it with the seed's
    initial weights (sharded; loaders overwrite them afterwards)."""
    setup = setup or set_up_job(config)
    with torch.device("meta"):
        model = family_of(setup.args).model_class(setup.args)
    parallelized = parallelize_llama(model, setup)
    model.to_empty(device=setup.device)
    init_sharded_weights(model, seed=config.training.seed, device=setup.device)
    return ParallelModel(
        setup=setup,
        model=model,
        cp_style=parallelized.cp_style,
        host_offload=parallelized.host_offload,
        forward_plan=parallelized.forward_plan,
    )


def load_initial_weights(built: ParallelModel) -> str:
    """Load [checkpoint] initial_load_path (a Hugging Face folder with initial_load_in_hf, else a
    DCP checkpoint) into the sharded model; returns what was loaded, for the start-up line.

    Callers load this only when there is no snapshot of the job itself to resume from.
    """
    config = built.setup.config
    folder = initial_load_folder(config)
    if not folder:
        return f"seed {config.training.seed} initial weights"
    if config.checkpoint.initial_load_in_hf:
        load_hf_weights(built.model, built.model.model_args, folder)
        return f"Hugging Face weights {folder}"
    load_dcp_weights(built.model, folder)
    return f"DCP weights {folder}"
