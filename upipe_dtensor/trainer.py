"""The training loop: FSDP2 + UPipe/Ulysses context parallelism (+ compile) on torchtitan's Llama3.

Each context-parallel rank feeds its contiguous 1/C slice of every sequence. The loss is the
global mean over all tokens of the step on all ranks: each rank backpropagates its shard's token
sum divided by the global token count (times the FSDP world size, since FSDP2 averages gradients
over dp_shard x cp), so gradients and the logged loss equal a single-device run on the same batch.
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist
from torchtitan.distributed.utils import clip_grad_norm_

from .build import build_parallel_model, load_initial_weights
from .checkpoint import Checkpointer
from .config import JobConfig
from .data import PackedTextLoader
from .metrics import MetricsLogger
from .models import flops_per_token
from .models.llama3 import IGNORE_INDEX
from .parallelize import DTYPES, ParallelMeshes
from .weights import save_hf_weights


def lr_lambda(config: JobConfig):
    """Linear warmup to the peak, then linear or cosine decay to ``min_lr_factor`` at the end."""
    warmup = config.lr_scheduler.warmup_steps
    total = config.training.steps
    decay_type = config.lr_scheduler.decay_type
    floor = config.lr_scheduler.min_lr_factor

    def factor(step: int) -> float:  # LambdaLR's step counts completed optimizer steps
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        shape = 1 - progress if decay_type == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * shape

    return factor


class Trainer:
    """Builds everything from a validated ``JobConfig``; ``train()`` runs the steps."""

    def __init__(
        self,
        config: JobConfig,
        *,
        meshes: ParallelMeshes | None = None,
        device: torch.device | None = None,
        host_device: torch.device = torch.device("cpu"),
        mixed_precision: bool | None = None,
    ) -> None:
        """By default the trainer picks its device (CUDA if present) and builds its meshes. The
        memory planner passes its own: meshes built before entering a FakeTensorMode (which cannot
        build one), a device, a stand-in ``host_device`` for offloaded activations, and
        ``mixed_precision=True`` to model a GPU run (default: mixed precision on CUDA only)."""
        self.parallel = built = build_parallel_model(
            config, meshes=meshes, device=device, host_device=host_device, mixed_precision=mixed_precision
        )
        self.config, self.model, self.device = config, built.model, built.device
        self.meshes, self.cp_style, self.host_offload = built.meshes, built.cp_style, built.host_offload
        self.cp_rank, self.cp, self.world_size = built.cp_rank, built.cp, built.world_size
        self.flops_per_token = flops_per_token(self.model, self.model.model_args, config.training.seq_len)
        training, dp, dp_rank, world_size = config.training, built.dp, built.dp_rank, built.world_size

        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=opt.lr,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            # The fused kernel needs the parameters on the GPU (not so under FSDP CPU offload).
            fused=self.device.type == "cuda" and not training.enable_cpu_offload,
        )
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))
        self.dataloader = PackedTextLoader(
            dataset=training.dataset,
            dataset_path=training.dataset_path,
            text_field=training.dataset_text_field,
            tokenizer=built.tokenizer,
            seq_len=training.seq_len,
            batch_size=training.local_batch_size,
            dp_rank=dp_rank,
            dp_world_size=dp,
        )
        dump = config.job.dump_folder
        self.checkpointer = (
            Checkpointer(
                os.path.join(dump, config.checkpoint.folder),
                interval=config.checkpoint.interval,
                keep_latest_k=config.checkpoint.keep_latest_k,
                model=self.model,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler,
                dataloader=self.dataloader,
                dp_rank=dp_rank,
            )
            if config.checkpoint.enable
            else None
        )
        self.metrics = MetricsLogger(
            log_dir=os.path.join(dump, config.metrics.save_tb_folder)
            if config.metrics.enable_tensorboard
            else None,
            log_freq=config.metrics.log_freq,
            device=self.device,
            flops_per_token=self.flops_per_token,
            world_size=world_size,
            enabled=dist.get_rank() == 0,
        )

    def shard_sequence(self, batch: torch.Tensor) -> torch.Tensor:
        """This CP rank's tokens of every sequence (dim 1), in the order its CP style expects."""
        return self.parallel.shard_sequence(batch)

    def train_step(
        self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over the micro-batches; returns (global mean loss, grad norm)."""
        shards = [
            (self.shard_sequence(inputs), self.shard_sequence(labels), self.parallel.document_inputs(inputs))
            for inputs, labels in microbatches
        ]
        tokens = sum((labels != IGNORE_INDEX).sum() for _, labels, _ in shards)
        dist.all_reduce(tokens)  # every token of the step on every rank
        loss_sum = torch.zeros((), device=self.device)
        for index, (inputs, labels, documents) in enumerate(shards):
            self.model.set_requires_gradient_sync(index == len(shards) - 1)
            shard_sum = self.model(inputs, labels=labels, **documents)
            (shard_sum * self.world_size / tokens).backward()
            loss_sum += shard_sum.detach()
        max_norm = self.config.training.max_norm
        grad_norm = clip_grad_norm_(self.model.parameters(), max_norm if max_norm > 0 else math.inf)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)
        return loss_sum / tokens, grad_norm

    def export_hf(self, step: int) -> str:
        """Write the model as a Hugging Face folder, {checkpoint folder}/step-N-hf; returns it."""
        config = self.config
        folder = os.path.join(config.job.dump_folder, config.checkpoint.folder, f"step-{step}-hf")
        save_hf_weights(
            self.model,
            self.model.model_args,
            folder,
            dtype=DTYPES[config.checkpoint.export_dtype],
            base_folder=config.model.hf_assets_path,
            tokenizer_folder=config.model.tokenizer_folder,
        )
        if dist.get_rank() == 0:
            print(f"wrote the Hugging Face model to {folder}", flush=True)
        return folder

    def train(self) -> list[float]:
        """Run to ``training.steps`` (resuming from the latest snapshot); returns the losses."""
        training = self.config.training
        start = self.checkpointer.load(self.config.checkpoint.load_step) if self.checkpointer else 0
        weights = f"snapshot step-{start}" if start else load_initial_weights(self.parallel)
        if dist.get_rank() == 0:
            print(
                f"{self.config.job.description}: {self.config.model.flavor}, seq_len "
                f"{training.seq_len}, cp {self.cp} ({self.config.parallelism.cp_style}), "
                f"world {self.world_size}, device {self.device.type}, from step {start} ({weights})",
                flush=True,
            )
        batches = iter(self.dataloader)
        tokens_per_step = (
            training.seq_len * training.local_batch_size * training.gradient_accumulation_steps
            * (self.world_size // self.cp)
        )
        losses = []
        for step in range(start + 1, training.steps + 1):
            began = time.perf_counter()
            microbatches = [next(batches) for _ in range(training.gradient_accumulation_steps)]
            loss, grad_norm = (t.item() for t in self.train_step(microbatches))
            losses.append(loss)
            self.metrics.log(
                step,
                loss=loss,
                grad_norm=grad_norm,
                lr=self.lr_scheduler.get_last_lr()[0],
                tokens=tokens_per_step,
                seconds=time.perf_counter() - began,
                host_offload_bytes=self.host_offload.peak_host_bytes if self.host_offload else None,
            )
            if self.checkpointer is not None:
                self.checkpointer.maybe_save(step, last=step == training.steps)
            if step == training.steps and self.config.checkpoint.last_save_in_hf:
                self.export_hf(step)
        self.metrics.close()
        return losses
