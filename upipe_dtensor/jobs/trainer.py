"""The training loop: FSDP2 + UPipe/Ulysses context parallelism (+ compile) on torchtitan's Llama3.

Each context-parallel rank feeds its contiguous 1/C slice of every sequence. The loss is the
global mean over all tokens of the step on all ranks: each rank backpropagates its shard's token
sum divided by the global token count (times the FSDP world size, since FSDP2 averages gradients
over dp_shard x cp), so gradients and the logged loss equal a single-device run on the same batch.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.distributed.utils import clip_grad_norm_

from upipe_dtensor.checkpointing.job_lock import JobLock
from upipe_dtensor.checkpointing.manifest import read_manifest
from upipe_dtensor.checkpointing.model_record import check_model_unchanged, model_record
from upipe_dtensor.checkpointing.outputs import refuse_nonempty
from upipe_dtensor.checkpointing.snapshots import (
    Checkpointer,
    choose_snapshot,
    resume_candidates,
    snapshots,
)
from upipe_dtensor.checkpointing.storage import (
    check_writable,
    snapshot_bytes_estimate,
    space_report,
)
from upipe_dtensor.checkpointing.weights import save_hf_weights, unloaded_hf_weights
from upipe_dtensor.config import ConfigError, JobConfig, check_job
from upipe_dtensor.data.checks import (
    BAD_RECORDS_FIX,
    DataScan,
    data_changes,
    data_fingerprint,
    scan_sources,
)
from upipe_dtensor.data.loader import PackedTextLoader, hub_unreachable
from upipe_dtensor.data.startup_warnings import data_warnings
from upipe_dtensor.jobs.build import (
    JobSetup,
    Placement,
    build_parallel_model,
    load_initial_weights,
    set_up_job,
)
from upipe_dtensor.jobs.parallelize import (
    DTYPES,
    ParallelMeshes,
    compile_report,
    describe_cp_style,
)
from upipe_dtensor.models import flops_per_token
from upipe_dtensor.models.hf_config import model_args
from upipe_dtensor.models.llama3 import IGNORE_INDEX
from upipe_dtensor.runtime.collectives import gather_dicts, on_every_rank, on_rank0
from upipe_dtensor.runtime.errors import JobError, JobStopped
from upipe_dtensor.runtime.metrics import MetricsLogger
from upipe_dtensor.runtime.rank_deaths import is_communication_failure, rank_processes
from upipe_dtensor.runtime.shutdown import StopRequests, watch_launcher

logger = logging.getLogger(__name__)


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
        memory planner decides them with ``placement`` (see ``jobs.setup.Placement``).
        ``exact_tokenizer``: the tokenizer must be the model's own (train.py: it trains on text;
        ``build.check_tokenizer_fits``)."""
        self.config = config
        # A real job checks its data first; the planner lays out fake ranks and reads no data.
        scan = _check_before_process_group(config) if placement.meshes is None else None
        self.setup = setup = set_up_job(config, placement, exact_tokenizer=exact_tokenizer)
        self.device = setup.device
        self.dataloader = on_every_rank(lambda: _build_loader(config, setup))
        self.data_fingerprint = data_fingerprint(
            self.dataloader.documents.description, scan.files if scan else None
        )
        dump = Path(config.job.dump_folder)
        checkpoint_folder = dump / config.checkpoint.folder
        self.lock = _claim(config, dump, checkpoint_folder)
        try:
            self._build(dump, checkpoint_folder)
        except BaseException:
            self.close()
            raise

    def _build(self, dump: Path, checkpoint_folder: Path) -> None:
        """Everything after the dump folder is claimed: the snapshot to resume from, the model,
        the optimizer, the checkpointer and the metrics."""
        config, training, setup = self.config, self.config.training, self.setup
        job = {
            "dp": setup.dp,
            "cp": setup.cp,
            "world_size": setup.world_size,
            "cp_style": config.parallelism.cp_style,
        }
        self.resume_from = (
            choose_snapshot(
                checkpoint_folder,
                resume_candidates(config, checkpoint_folder),
                explicit=config.checkpoint.load_step != -1,
                job=job,
            )
            if config.checkpoint.enable
            else None
        )
        self.start_step = _snapshot_step(self.resume_from) if self.resume_from else 0
        if self.resume_from is not None:
            args = model_args(config.model, training.seq_len)
            check_model_unchanged(self.resume_from, config, args, rank0=dist.get_rank() == 0)
            on_every_rank(lambda: self._check_data_unchanged(self.resume_from))

        self.parallel = built = build_parallel_model(config, setup)
        self.model, self.cp_style, self.host_offload = (
            built.model,
            built.cp_style,
            built.host_offload,
        )
        self.flops_per_token = flops_per_token(self.model, self.model.model_args, training.seq_len)

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
        self.checkpointer = None
        if config.checkpoint.enable:
            self.checkpointer = Checkpointer(
                str(checkpoint_folder),
                interval=config.checkpoint.interval,
                keep_latest_k=config.checkpoint.keep_latest_k,
                model=self.model,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler,
                dataloader=self.dataloader,
                dp_rank=setup.dp_rank,
                job=job,
                data=self._data_record,
                model_settings=model_record(config, self.model.model_args),
            )
            self.checkpointer.snapshot_bytes = snapshot_bytes_estimate(self.model)
            report = on_rank0(
                lambda: space_report(
                    checkpoint_folder,
                    self.checkpointer.snapshot_bytes,
                    config.checkpoint.keep_latest_k,
                    kept=len(snapshots(checkpoint_folder)),
                    saves_left=self._saves_left(),
                )
            )
            if dist.get_rank() == 0:
                print(
                    report,
                    file=sys.stderr if report.startswith("WARNING") else sys.stdout,
                    flush=True,
                )
        self.metrics = MetricsLogger(
            log_dir=str(dump / config.metrics.save_tb_folder)
            if config.metrics.enable_tensorboard
            else None,
            log_freq=config.metrics.log_freq,
            device=self.device,
            flops_per_token=self.flops_per_token,
            world_size=setup.world_size,
            enabled=dist.get_rank() == 0,
            first_step=self.start_step + 1,
        )

    def _data_record(self) -> dict:
        """The fingerprint of the data consumed, for a snapshot's manifest (collective): the
        files as the job found them and, per data-parallel rank, what it has read."""
        read = gather_dicts({str(self.setup.dp_rank): self.dataloader.read_state()})
        return {**self.data_fingerprint, "read": read}

    def _check_data_unchanged(self, snapshot: Path) -> None:
        """Refuse to resume on data other than the snapshot consumed (unless [checkpoint]
        accept_data_change): the loader's position is a document index, which on other data
        points elsewhere. Snapshots written before fingerprints existed are not checked."""
        saved = (read_manifest(snapshot) or {}).get("data")
        if saved is None:
            return
        changes = data_changes(
            saved, self.data_fingerprint, self.setup.dp_rank, self.dataloader.documents
        )
        if not changes:
            return
        if not self.config.checkpoint.accept_data_change:
            raise ConfigError(
                f"the training data changed since snapshot {snapshot} was saved: {changes}. "
                "Restore the data, or set [checkpoint] accept_data_change = true to resume on the "
                "data as it is now, or set another [job] dump_folder to start over"
            )
        if dist.get_rank() == 0:
            print(
                f"WARNING: the training data changed since snapshot {snapshot} was saved: "
                f"{changes}; resuming on it ([checkpoint] accept_data_change = true)",
                file=sys.stderr,
                flush=True,
            )

    def _saves_left(self) -> int:
        interval, steps = self.config.checkpoint.interval, self.config.training.steps
        periodic = steps // interval - self.start_step // interval
        return periodic + (steps % interval != 0)

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
        dist.all_reduce(tokens)  # every token of the step on every rank
        loss_sum = torch.zeros((), device=self.device)
        for index, (inputs, labels, documents) in enumerate(shards):
            self.model.set_requires_gradient_sync(index == len(shards) - 1)
            shard_sum = self.parallel(inputs, labels=labels, **documents)
            (shard_sum * self.setup.world_size / tokens).backward()
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
            f"{setup.attention_choice} attention kernels, cp "
            f"{setup.cp} x dp {setup.dp} = {ranks} on {self.device.type}, steps "
            f"{self.start_step + 1}..{config.training.steps}, from {weights} "
            f"[{config.config_file or 'no config file'}{_described(config)}]"
        )

    def train(self) -> list[float]:
        """Run to ``training.steps`` (resuming from the chosen snapshot); returns the losses.

        Stops with ``JobError`` on a non-finite loss or gradient norm (nothing is saved), and with
        ``JobStopped`` after SIGTERM, SIGUSR1 or Ctrl-C (a snapshot is saved at the step
        boundary; a second Ctrl-C exits at once, ``shutdown.StopRequests``)."""
        training = self.config.training
        tokens_per_step = (
            training.seq_len
            * training.local_batch_size
            * training.gradient_accumulation_steps
            * (self.setup.world_size // self.setup.cp)
        )
        stop = StopRequests(
            self.config.job.stop_grace_seconds,
            self._resume_hint(),
            standing_step=self.start_step,
            peers=rank_processes(),
        )
        watch_launcher()
        try:
            start = 0
            if self.resume_from is not None:
                start = self.checkpointer.load(self.resume_from)
                self._follow_schedule()
                stop.standing(self._resume_hint(), start)
                weights = f"snapshot {self.resume_from}"
            else:
                weights = load_initial_weights(self.parallel)
            if dist.get_rank() == 0:
                print(self.describe(weights), flush=True)
                if self.config.parallelism.ring_degree > 1:
                    print(describe_rank_groups(self.setup.meshes), flush=True)
            batches = iter(self.dataloader)
            losses = []
            try:
                for step in range(start + 1, training.steps + 1):
                    stop.step_begins(step)
                    losses.append(self._run_step(step, batches, stop, tokens_per_step))
            except RuntimeError as err:
                if isinstance(err, JobError) or not is_communication_failure(err):
                    raise
                stop.failed_collective(err)  # a rank died: one line, and this rank exits
        finally:
            stop.close()
            self.metrics.close()
            self.close()
        return losses

    def _run_step(self, step: int, batches, stop: StopRequests, tokens_per_step: int) -> float:
        """One step with its log line, its boundary (the agreed stop signal, the snapshot, the
        export) and its loss."""
        training = self.config.training
        began = time.perf_counter()
        microbatches = [next(batches) for _ in range(training.gradient_accumulation_steps)]
        lr = self.optimizer.param_groups[0]["lr"]  # this step's rate (the scheduler moves on)
        loss, grad_norm = (t.item() for t in self.train_step(microbatches))
        if step == self.start_step + 1 and self.config.compile.enable and dist.get_rank() == 0:
            print(compile_report(self.config.compile.backend), flush=True)
        self.metrics.log(
            step,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            tokens=tokens_per_step,
            seconds=time.perf_counter() - began,
            host_offload_bytes=self.host_offload.peak_host_bytes if self.host_offload else None,
        )
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise JobError(
                f"step {step}: loss {loss:.4g}, grad_norm {grad_norm:.4g}: not finite; "
                f"stopped without saving ({self._resume_hint()}). Lower [optimizer] lr or "
                "raise [lr_scheduler] warmup_steps, then run again"
            )
        signum = stop.agreed(self.device)
        if self.checkpointer is not None:
            self.checkpointer.maybe_save(step, last=step == training.steps or bool(signum))
            if self.checkpointer.latest is not None:
                stop.standing(self._resume_hint(), _snapshot_step(self.checkpointer.latest))
        if step == training.steps and self.config.checkpoint.last_save_in_hf:
            self.export_hf(step)
        if signum and step < training.steps:
            raise JobStopped(
                f"stopped by {signal.Signals(signum).name} after step {step} of "
                f"{training.steps} ({self._resume_hint()}); run the same command to resume",
                signum,
            )
        return loss

    def _follow_schedule(self) -> None:
        """Set the learning rate from this job's schedule at the resumed step: the snapshot holds
        the rate its own ``[training] steps`` gave, which differs once steps is raised."""
        factor = lr_lambda(self.config)(self.lr_scheduler.last_epoch)
        for group, base_lr in zip(self.optimizer.param_groups, self.lr_scheduler.base_lrs):
            group["lr"] = base_lr * factor

    def _resume_hint(self) -> str:
        if self.checkpointer is None:
            return "checkpointing is off: nothing to resume from"
        return self.checkpointer.describe_latest()

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


def _snapshot_step(snapshot: Path) -> int:
    """The step a ``step-N`` snapshot folder holds."""
    return int(snapshot.name.split("-")[1])


def describe_rank_groups(meshes: ParallelMeshes) -> str:
    """The 2D layout in global ranks, for the start-up log: the head groups (all-to-all) should
    each be one node's ranks and every ring group should join the nodes; torchrun numbers ranks
    node by node, so a wrong launch shows here."""
    ranks = meshes.world.mesh  # (dp_shard, cp_ring, cp_heads) global ranks
    dp, ring, heads = ranks.shape
    return (
        f"mesh dp_shard {dp} x cp_ring {ring} x cp_heads {heads}: head groups (all-to-all, "
        f"inside a node) {ranks.flatten(0, 1).tolist()}, ring groups (across nodes) "
        f"{ranks.transpose(1, 2).flatten(0, 1).tolist()}"
    )


def _build_loader(config: JobConfig, setup: JobSetup) -> PackedTextLoader:
    """The data loader, after reading up to this rank's first document: an empty corpus or a bad
    first record is a ConfigError now, not a traceback after the model is built."""
    training = config.training
    try:
        loader = PackedTextLoader(
            dataset=training.dataset,
            dataset_path=training.dataset_path,
            dataset_config_name=training.dataset_config_name,
            split=training.dataset_split,
            text_field=training.dataset_text_field,
            tokenizer=setup.tokenizer,
            seq_len=training.seq_len,
            batch_size=training.local_batch_size,
            dp_rank=setup.dp_rank,
            dp_world_size=setup.dp,
            skip_bad_records=training.skip_bad_records,
            sources=training.sources,
            seed=training.seed,
        )
        loader.check_first_document()
    except ValueError as err:
        keys = (
            "training.dataset",
            "training.dataset_config_name",
            "training.dataset_split",
            "training.dataset_path",
            "training.dataset_text_field",
            "training.sources",
            "model.tokenizer_path",
        )
        raise ConfigError(f"{config.source_of(*keys)}: [training] data: {err}") from err
    return loader


def _check_before_process_group(config: JobConfig) -> DataScan | None:
    """The config, the outputs, then the data, before any process group: mistakes that take no
    reading first, then every local record (``_check_data``)."""
    world_size = (
        dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    )
    dp = check_job(config, world_size)
    if config.checkpoint.last_save_in_hf:
        folder = Path(config.job.dump_folder) / config.checkpoint.folder
        refuse_nonempty(
            folder / f"step-{config.training.steps}-hf",
            "the Hugging Face export after the last step goes there and replaces nothing it did "
            "not write: move it away, or set [checkpoint] last_save_in_hf = false",
        )
    _check_initial_weights(config)
    return _check_data(config, dp)


def _check_initial_weights(config: JobConfig) -> None:
    """A job that starts fresh from the seed's weights beside a folder of pretrained ones says
    which it means (``weights.unloaded_hf_weights``); a job resuming from its snapshots loads
    neither."""
    folder = Path(config.job.dump_folder) / config.checkpoint.folder
    if config.checkpoint.enable and snapshots(folder):
        return
    if why := unloaded_hf_weights(config):
        keys = ("model.hf_assets_path", "model.flavor", "checkpoint.initial_load_in_hf")
        raise ConfigError(f"{config.source_of(*keys)}: {why}")


def _check_data(config: JobConfig, dp: int) -> DataScan | None:
    """Every record of the local training data, read once: bad records are a ConfigError naming
    the first few by file and line, or, with [training] skip_bad_records, skipped and counted in
    a warning; data that will train badly gets a warning line (``data.startup_warnings``). A
    token folder is not read (its manifest stands for it). A Hugging Face dataset is only
    probed: an unreachable Hub fails in seconds."""
    training = config.training
    where = config.source_of(
        "training.dataset",
        "training.dataset_path",
        "training.dataset_text_field",
        "training.sources",
    )
    try:
        if training.dataset != "local":
            if why := hub_unreachable(training.dataset):
                raise ValueError(why)
            return None
        scan = scan_sources([s.path for s in training.data_sources], training.dataset_text_field)
    except ValueError as err:
        raise ConfigError(f"{where}: [training] data: {err}") from err
    if scan.bad_count and not training.skip_bad_records:
        raise ConfigError(f"{where}: [training] data: {scan.bad_summary()}; {BAD_RECORDS_FIX}")
    if os.environ.get("RANK", "0") != "0":
        return scan
    if scan.bad_count:
        print(
            f"WARNING: skipping {scan.bad_summary()} ([training] skip_bad_records = true)",
            file=sys.stderr,
            flush=True,
        )
    try:
        for line in data_warnings(config, scan, dp):
            logger.warning(line)
    except ValueError as err:  # the tokenizer, which every rank reports after set-up
        logger.debug("no data warnings: %s", err)
    return scan


def _claim(config: JobConfig, dump: Path, checkpoint_folder: Path) -> JobLock | None:
    """Rank 0 checks that the folders this job writes are writable and locks the dump folder
    (every rank raises the same ``JobError`` if not). Nothing is written without tensorboard and
    checkpoints (as in the planner), so then there is nothing to claim."""
    if not (config.checkpoint.enable or config.metrics.enable_tensorboard):
        return None
    lock = JobLock(dump) if dist.get_rank() == 0 else None

    def claim() -> None:
        fix = "fix its permissions or set [job] dump_folder (and [checkpoint] folder) elsewhere"
        check_writable(dump, "dump folder", fix)
        if config.checkpoint.enable:
            check_writable(checkpoint_folder, "checkpoint folder", fix)
        lock.acquire()

    on_rank0(claim)
    return lock
