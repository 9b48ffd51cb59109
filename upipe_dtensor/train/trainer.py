"""The training loop: FSDP2 + UPipe/Ulysses context parallelism (+ compile) on torchtitan's Llama3.

Each context-parallel rank feeds its contiguous 1/C slice of every sequence. The loss is the
global mean over all tokens of the step on all ranks: each rank backpropagates its shard's token
sum divided by the global token count (times the FSDP world size, since FSDP2 averages gradients
over dp_shard x cp), so gradients and the logged loss equal a single-device run on the same batch.

The loop calls the modules that own everything else: ``preflight`` (the checks before the model),
``resume`` (the snapshot to resume from, the checkpointer), ``optimizer`` (AdamW and the LR
schedule), ``export`` (the Hugging Face folder after the last step), ``runtime.metrics`` (the
step line and the sinks) and ``runtime.shutdown`` (stop signals).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.distributed.utils import clip_grad_norm_

from upipe_dtensor.checkpointing.job_lock import JobLock, claim_dump_folder
from upipe_dtensor.config import JobConfig
from upipe_dtensor.config.schema import Metrics
from upipe_dtensor.data.checks import data_fingerprint
from upipe_dtensor.models import IGNORE_INDEX, flops_per_token
from upipe_dtensor.runtime.collectives import gather_dicts, on_every_rank
from upipe_dtensor.runtime.errors import JobError, JobStopped
from upipe_dtensor.runtime.metrics import (
    JsonlSink,
    MetricsLogger,
    MetricsSink,
    TensorBoardSink,
    WandbSink,
)
from upipe_dtensor.runtime.rank_deaths import is_communication_failure, rank_processes
from upipe_dtensor.runtime.shutdown import StopRequests, watch_launcher
from upipe_dtensor.train.build import build_parallel_model, load_initial_weights, set_up_job
from upipe_dtensor.train.export import export_hf
from upipe_dtensor.train.optimizer import (
    balance_experts,
    build_lr_scheduler,
    build_optimizer,
    follow_schedule,
)
from upipe_dtensor.train.parallelize import compile_report, describe_cp_style
from upipe_dtensor.train.preflight import check_before_process_group, checked_loader
from upipe_dtensor.train.resume import (
    check_resumable,
    choose_resume,
    job_checkpointer,
    job_geometry,
    resume_hint,
    snapshot_step,
)
from upipe_dtensor.train.setup import Placement

logger = logging.getLogger(__name__)


def open_sinks(
    metrics: Metrics, dump_folder: Path, first_step: int, run_config: Mapping[str, Any]
) -> list[MetricsSink]:
    """The sinks ``[metrics]`` turns on, writing under ``dump_folder`` (rank 0 opens them)."""
    sinks: list[MetricsSink] = []
    if metrics.enable_tensorboard:
        sinks.append(TensorBoardSink(dump_folder / metrics.save_tb_folder, first_step))
    if metrics.enable_jsonl:
        sinks.append(JsonlSink(dump_folder / metrics.save_jsonl_file, first_step))
    if metrics.enable_wandb:
        sinks.append(WandbSink(dump_folder, run_config))
    return sinks


class Trainer:
    """Builds everything from a validated ``JobConfig``; ``train()`` runs the steps.

    Everything that can be wrong with the job is found before the model is built: the config and
    every record of the local data (``ConfigError``, before any process group), the tokenizer,
    the dump folder (writable, not used by another job, no earlier Hugging Face export where this
    one goes), and the snapshot to resume from (a finished job raises ``JobComplete``; damaged
    snapshots are reported and skipped; another data-parallel degree, or data that changed since
    the snapshot, is refused).
    """

    def __init__(
        self,
        config: JobConfig,
        *,
        placement: Placement = Placement(),
        exact_tokenizer: bool = False,
    ) -> None:
        """By default the trainer picks its device (CUDA if present) and builds its meshes; the
        memory planner decides them with ``placement`` (see ``train.setup.Placement``).
        ``exact_tokenizer``: the tokenizer must be the model's own (train.py: it trains on text;
        ``build.check_tokenizer_fits``)."""
        self.config = config
        # A real job checks its data first; the planner lays out fake ranks and reads no data.
        scan = check_before_process_group(config) if placement.meshes is None else None
        self.setup = setup = set_up_job(config, placement, exact_tokenizer=exact_tokenizer)
        self.device = setup.device
        self.dataloader = on_every_rank(lambda: checked_loader(config, setup))
        self.data_fingerprint = data_fingerprint(
            self.dataloader.documents.description, scan.files if scan else None
        )
        self.dump = Path(config.job.dump_folder)
        self.checkpoint_folder = self.dump / config.checkpoint.folder
        metrics = config.metrics
        self.lock: JobLock | None = None
        if (
            config.checkpoint.enable
            or metrics.enable_tensorboard
            or metrics.enable_jsonl
            or (metrics.enable_wandb)
        ):  # else nothing is written (as in the planner): nothing to claim
            folder = self.checkpoint_folder if config.checkpoint.enable else None
            self.lock = claim_dump_folder(self.dump, folder)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        """Everything after the dump folder is claimed: the snapshot to resume from, the model,
        the optimizer and the checkpointer."""
        config, setup = self.config, self.setup
        self.resume_from = choose_resume(
            config, self.checkpoint_folder, job_geometry(config, setup)
        )
        self.start_step = snapshot_step(self.resume_from) if self.resume_from else 0
        if self.resume_from is not None:
            check_resumable(self.resume_from, setup, self.data_fingerprint, self.dataloader)
        self.parallel = built = build_parallel_model(config, setup)
        self.model, self.cp_style, self.host_offload = (
            built.model,
            built.cp_style,
            built.host_offload,
        )
        self.flops_per_token = flops_per_token(
            self.model, self.model.model_args, config.training.seq_len
        )
        self.optimizer = build_optimizer(self.model, config, self.device)
        balance_experts(self.optimizer, self.model, setup.meshes.fsdp)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config)
        self.checkpointer = None
        if config.checkpoint.enable:
            self.checkpointer = job_checkpointer(
                config,
                setup,
                self.checkpoint_folder,
                model=self.model,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler,
                dataloader=self.dataloader,
                data=self._data_record,
                start_step=self.start_step,
            )

    def _data_record(self) -> dict:
        """The fingerprint of the data consumed, for a snapshot's manifest (collective): the
        files as the job found them and, per data-parallel rank, what it has read."""
        read = gather_dicts({str(self.setup.dp_rank): self.dataloader.read_state()})
        return {**self.data_fingerprint, "read": read}

    def shard_sequence(self, batch: torch.Tensor) -> torch.Tensor:
        """This CP rank's tokens of every sequence (dim 1), in the order its CP style expects."""
        return self.parallel.shard_sequence(batch)

    def train_step(
        self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over the micro-batches; returns (global mean loss, grad norm)."""
        shards = [
            (
                self.shard_sequence(inputs),
                self.shard_sequence(labels),
                self.parallel.document_inputs(inputs),
            )
            for inputs, labels in microbatches
        ]
        tokens = sum((labels != IGNORE_INDEX).sum() for _, labels, _ in shards)
        # Every token of the step on every rank: each CP shard once (its tensor-parallel ranks
        # share it, each computing the loss of 1/tp of its tokens).
        fsdp = self.setup.meshes.fsdp
        dist.all_reduce(tokens, group=fsdp.get_group())
        loss_sum = torch.zeros((), device=self.device)
        for index, (inputs, labels, documents) in enumerate(shards):
            self.model.set_requires_gradient_sync(index == len(shards) - 1)
            shard_sum = self.parallel(inputs, labels=labels, **documents)
            # FSDP2 averages the gradients over its dp x cp ranks; tensor parallelism sums them.
            (shard_sum * fsdp.size() / tokens).backward()
            loss_sum += shard_sum.detach()
        max_norm = self.config.training.max_norm
        # Expert-parallel experts live on their own mesh: torchtitan sums their norm apart.
        expert_parallel = (
            {"ep_enabled": True} if self.config.parallelism.expert_parallel_degree > 1 else {}
        )
        grad_norm = clip_grad_norm_(
            self.model.parameters(), max_norm if max_norm > 0 else math.inf, **expert_parallel
        )
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)
        return loss_sum / tokens, grad_norm

    def describe(self, weights: str) -> str:
        """The start-up line: the job as it will actually run. The config's free-text description
        comes last, quoted; when the command line overrides the model, the sequence length or the
        parallelism, which such a description states, the overrides are named instead."""
        config = self.config
        style = describe_cp_style(config.parallelism, self.model.model_args.n_heads)
        setup = self.setup
        ranks = f"{setup.world_size} rank{'s' * (setup.world_size != 1)}"
        return (
            f"training {config.model.name} {config.model.flavor}, "
            f"seq_len {config.training.seq_len:,}, {style}, "
            f"{setup.attention_choice} attention kernels, cp {setup.cp}"
            + (f" x tp {setup.tp}" if setup.tp > 1 else "")
            + f" x dp {setup.dp} = {ranks} on {self.device.type}, steps "
            f"{self.start_step + 1}..{config.training.steps}, from {weights} "
            f"[{config.config_file or 'no config file'}{_described(config)}]"
        )

    def train(self) -> list[float]:
        """Run to ``training.steps`` (resuming from the chosen snapshot); returns the losses.

        Stops with ``JobError`` on a non-finite loss or gradient norm (nothing is saved), and with
        ``JobStopped`` after SIGTERM, SIGUSR1 or Ctrl-C (a snapshot is saved at the step
        boundary; a second Ctrl-C exits at once, ``shutdown.StopRequests``)."""
        training = self.config.training
        stop = StopRequests(
            self.config.job.stop_grace_seconds, self._standing, peers=rank_processes()
        )
        watch_launcher()
        self.metrics: MetricsLogger | None = None
        try:
            self.metrics = self._metrics()
            start = 0
            if self.resume_from is not None:
                start = self.checkpointer.load(self.resume_from)
                follow_schedule(self.lr_scheduler, self.config)
                weights = f"snapshot {self.resume_from}"
            else:
                weights = load_initial_weights(self.parallel)
            logger.info(self.describe(weights))
            if self.config.parallelism.ring_degree > 1:
                logger.info(self.setup.meshes.describe_rank_groups())
            batches = iter(self.dataloader)
            losses = []
            try:
                for step in range(start + 1, training.steps + 1):
                    stop.step_begins(step)
                    losses.append(self._run_step(step, batches, stop))
            except RuntimeError as err:
                if isinstance(err, JobError) or not is_communication_failure(err):
                    raise
                stop.failed_collective(err)  # a rank died: one line, and this rank exits
        finally:
            stop.close()
            if self.metrics is not None:
                self.metrics.close()
            self.close()
        return losses

    def _standing(self) -> tuple[str, int]:
        """The snapshot a stop without a new one leaves as the resume point, and its step: the
        one loaded or saved last (read by ``StopRequests`` when a signal arrives)."""
        latest = self.checkpointer.latest if self.checkpointer is not None else None
        step = self.start_step if latest is None else snapshot_step(latest)
        return resume_hint(self.checkpointer), step

    def _metrics(self) -> MetricsLogger:
        """The step line on every rank (shown on rank 0 by default, ``runtime.logs``) and
        ``[metrics]``'s sinks on rank 0, opened when training starts (the planner, which only
        runs steps, opens none)."""
        config, setup = self.config, self.setup
        sinks = (
            open_sinks(config.metrics, self.dump, self.start_step + 1, dataclasses.asdict(config))
            if dist.get_rank() == 0
            else []
        )
        return MetricsLogger(
            sinks=sinks,
            log_freq=config.metrics.log_freq,
            device=self.device,
            flops_per_token=self.flops_per_token,
            world_size=setup.world_size,
        )

    def _run_step(self, step: int, batches, stop: StopRequests) -> float:
        """One step with its log line, its boundary (the agreed stop signal, the snapshot, the
        export) and its loss."""
        training, setup = self.config.training, self.setup
        began = time.perf_counter()
        microbatches = [next(batches) for _ in range(training.gradient_accumulation_steps)]
        lr = self.optimizer.param_groups[0]["lr"]  # this step's rate (the scheduler moves on)
        loss, grad_norm = (t.item() for t in self.train_step(microbatches))
        if step == self.start_step + 1 and self.config.compile.enable:
            logger.info(compile_report(self.config.compile.backend))
        scalars = {"loss": loss, "grad_norm": grad_norm, "lr": lr}
        if self.host_offload:
            scalars["host_offload_gib"] = self.host_offload.peak_host_bytes / 2**30
        self.metrics.log(
            step,
            scalars,
            tokens=training.seq_len
            * training.local_batch_size
            * training.gradient_accumulation_steps
            * setup.dp,
            seconds=time.perf_counter() - began,
        )
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise JobError(
                f"step {step}: loss {loss:.4g}, grad_norm {grad_norm:.4g}: not finite; "
                f"stopped without saving ({resume_hint(self.checkpointer)}). Lower [optimizer] "
                "lr or raise [lr_scheduler] warmup_steps, then run again"
            )
        signum = stop.agreed(self.device)
        if self.checkpointer is not None:
            self.checkpointer.maybe_save(step, last=step == training.steps or bool(signum))
        if step == training.steps and self.config.checkpoint.last_save_in_hf:
            export_hf(self.model, self.config, step)
        if signum and step < training.steps:
            raise JobStopped(
                f"stopped by {signal.Signals(signum).name} after step {step} of "
                f"{training.steps} ({resume_hint(self.checkpointer)}); run the same command to "
                "resume",
                signum,
            )
        return loss

    def close(self) -> None:
        """Release the dump folder for the next job (also released if the process dies)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _described(config: JobConfig) -> str:
    """The job file's description for the start-up line, or the command-line overrides that
    make it untrue (a style, a model, a length)."""
    overrides = [
        f"--{key} {config.value(key)}"
        for key, where in config.sources.items()
        if where == "command line"
        and (key.startswith(("parallelism.", "model.")) or key == "training.seq_len")
    ]
    if overrides:
        return f" with {' '.join(overrides)}"
    return f": {config.job.description!r}"
