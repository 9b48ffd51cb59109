"""UPipe (and Ulysses, ring, FPDT, UPipe x FPDT) inside torchtitan 0.2.2's own trainer.

Importing this module registers one torchtitan train spec per model family this project runs,
``llama3_upipe`` and ``qwen3_upipe``: torchtitan's own ``llama3`` / ``qwen3`` spec (model,
flavors, tokenizer, data loader, loss, optimizer, checkpoint adapter) whose ``parallelize_fn``
first applies the ``[upipe]`` section's CP style to every ``layers.*.attention`` over
torchtitan's ``cp`` mesh, then hands the model to torchtitan's own parallelize function, which
applies its activation checkpointing, ``torch.compile`` and FSDP2 (over ``dp_shard x cp``, as for
its own CP) exactly as for the plain spec, with its own CP skipped. Loaded through torchtitan's
own extension flags (or the same keys in a job file: ``train_configs/torchtitan/``)::

    torchrun --nproc_per_node 8 -m torchtitan.train --job.config_file YOUR_llama3_8b.toml \\
        --experimental.custom_import upipe_dtensor.integrations.torchtitan \\
        --job.custom_config_module upipe_dtensor.integrations.torchtitan \\
        --model.name llama3_upipe --parallelism.context_parallel_degree 8

``--job.custom_config_module`` adds the ``[upipe]`` section (``UPipe`` below: ``cp_style``, the
styles' options under their ``[parallelism]`` names such as ``heads_per_stage`` and
``chunk_tokens``, ``attention_backend``, the tiled MLP and RMSNorm), checked by the same
function as a job file of this project (``parallel.registry.make_style``). Without it the
section's defaults apply: UPipe with U = C.

**Who lays out the sequence.** torchtitan's ``Trainer`` cuts each sequence itself, by
``[parallelism] context_parallel_load_balancer``: none gives rank r the contiguous slice (the
UPipe and Ulysses layout), ``"headtail"`` gives it chunks r and 2C-1-r of 2C (ring attention's
zigzag). A layout the style does not expect would keep RoPE right (torchtitan passes the
positions) and get the causal order silently wrong, so the spec's ``parallelize_fn`` compares
the two for every rank and refuses a mismatch with one line naming the balancer that fits. With
this config module the balancer's default is none (TOML cannot write None), so UPipe and
Ulysses need nothing and ring attention asks for ``"headtail"``. FPDT's chunk-strided layout
(and UPipe x FPDT's) has no torchtitan balancer: run ``python -m
upipe_dtensor.integrations.torchtitan`` (same arguments), torchtitan's ``main`` with
``UPipeTrainer``, whose post-dataloading step lays out inputs and labels by the style's
``shard_positions``; it takes every style and ignores the balancer.

**Checked first.** ``python -m upipe_dtensor.integrations.torchtitan`` (``main``) makes every check
that needs no device (the ``[upipe]`` options, the geometry, tensor parallelism) from the job
config alone, before torchtitan sets up a device or a process group: a mistake is one line, once
per launch, exit 2, on any machine; ``--check-only`` makes them alone and says what would run
(torchtitan 0.2.2 trains on CUDA only, so that is what a CPU machine can try). Under ``-m
torchtitan.train`` the same checks run in the spec's ``parallelize_fn``, after torchtitan's
device set-up.

**What needs this project's trainer** (``train.py``), not silently dropped here:

- 2D (``ring_degree > 1``): torchtitan's ``ParallelDims`` builds one ``cp`` mesh dimension, not
  the ``(cp_ring, cp_heads)`` mesh; refused at start-up.
- tensor parallelism: the fused attention op computes with unsharded projection weights; refused.
- the chunked loss: torchtitan's loss takes the full logits.
- kept attention (device or host) and host-offloaded activations: they ride on this project's
  checkpoint wrapper, not torchtitan's ``apply_ac``.
- documents (``attention_mask = "document"``): torchtitan's sdpa models have no document ids to
  pass; its flex/varlen masks are refused by the styles.
- RoPE at millions of tokens: torchtitan's model keeps its (max_seq_len x head_dim/2) complex64
  table, float32 angles, on every GPU; this project's computes each shard's angles in float64.
- the planner (``plan``), whose traced step is this project's trainer.
- pipeline parallelism: untested with the styles, so these specs declare none and torchtitan
  refuses ``pipeline_parallel_degree > 1`` itself.
"""

import contextvars
import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec
from torchtitan.train import Trainer

from upipe_dtensor.errors import ConfigError
from upipe_dtensor.integrations.torchtitan.common import (
    UPipe,
    WithoutTorchtitanCP,
    applied_style,
    check_load_balancer,
    make_cp_style,
    refuse_tensor_parallelism,
    torchtitan_layout,
)
from upipe_dtensor.kernels.inductor import register_inductor_fallbacks
from upipe_dtensor.memory.rms_norm import apply_tiled_rms_norm
from upipe_dtensor.memory.tiled_mlp import apply_tiled_mlp
from upipe_dtensor.models.family import FAMILIES
from upipe_dtensor.parallel import ContextParallelAttention
from upipe_dtensor.runtime.errors import run_main

__all__ = [
    "CHECK_ONLY",
    "JobConfig",
    "UPipe",
    "UPipeTrainer",
    "check_job_config",
    "check_load_balancer",
    "main",
    "make_cp_style",
    "parallelize_with_style",
    "register_train_specs",
    "torchtitan_layout",
]

logger = logging.getLogger(__name__)

SPEC_SUFFIX = "_upipe"
"""``[model] name`` of a family's spec here: torchtitan's name plus this."""


@dataclass
class Parallelism:
    context_parallel_load_balancer: str | None = None
    """How torchtitan's trainer cuts each sequence over the cp ranks: None (the default with this
    config module) the contiguous slices UPipe, Ulysses and single-chunk FPDT expect, 'headtail'
    chunks r and 2C-1-r of 2C (ring attention's zigzag). A mismatch with [upipe] cp_style is
    refused at start-up."""


@dataclass
class JobConfig:
    """What ``--job.custom_config_module upipe_dtensor.integrations.torchtitan`` adds to
    torchtitan's job config (torchtitan's ``ConfigManager`` merges it)."""

    upipe: UPipe = field(default_factory=UPipe)  # type: ignore[valid-type]
    parallelism: Parallelism = field(default_factory=Parallelism)


_STYLE_LAYS_OUT_INPUTS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "style_lays_out_inputs", default=False
)
"""True while ``UPipeTrainer`` builds its model: its inputs are laid out by the style, so the
load balancer is not compared with the style's layout."""


def upipe_settings(job_config: Any) -> Any:
    """The job's ``[upipe]`` section; its defaults when the config module was not loaded."""
    section = getattr(job_config, "upipe", None)
    if section is None:
        logger.info(
            "no [upipe] section (--job.custom_config_module upipe_dtensor.integrations."
            "torchtitan adds it): UPipe with its defaults"
        )
        return UPipe()
    return section


def checked_style(
    args: Any, job_config: Any, cp_degree: int, *, lays_out_inputs: bool
) -> ContextParallelAttention:
    """The ``[upipe]`` style for torchtitan model ``args`` over ``cp_degree`` ranks, with every
    check that needs no device: the options and the geometry (``make_cp_style``) and, unless the
    trainer lays out its inputs by the style, the balancer's layout (``check_load_balancer``)."""
    seq_len = job_config.training.seq_len
    style = make_cp_style(args, upipe_settings(job_config), cp_degree, seq_len)
    if not lays_out_inputs:
        balancer = job_config.parallelism.context_parallel_load_balancer
        check_load_balancer(style, balancer, seq_len, cp_degree)
    return style


def parallelize_with_style(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: Any,
    *,
    then: Callable[..., nn.Module],
) -> nn.Module:
    """A train spec's ``parallelize_fn``: the ``[upipe]`` style on every attention module over
    torchtitan's cp mesh, the tiled MLP and RMSNorm if asked, then ``then`` (torchtitan's own
    parallelize function: activation checkpointing, compile, FSDP) with its CP skipped."""
    refuse_tensor_parallelism(parallel_dims.tp if parallel_dims.tp_enabled else 1)
    settings = upipe_settings(job_config)
    if parallel_dims.cp_enabled:
        style = checked_style(
            model.model_args,
            job_config,
            parallel_dims.cp,
            lays_out_inputs=_STYLE_LAYS_OUT_INPUTS.get(),
        )
        balancer = job_config.parallelism.context_parallel_load_balancer
        parallelize_module(model, parallel_dims.get_mesh("cp"), {"layers.*.attention": style})
        logger.info(
            "[upipe] %s over cp %d, inputs laid out by %s",
            style,
            parallel_dims.cp,
            "the style" if _STYLE_LAYS_OUT_INPUTS.get() else f"balancer {balancer!r}",
        )
    else:
        logger.info("[upipe] context_parallel_degree = 1: no CP style applied")
    if settings.tiled_mlp:
        apply_tiled_mlp(model, settings.mlp_tile_tokens)
    if settings.tiled_rms_norm:
        apply_tiled_rms_norm(model, settings.norm_tile_tokens)
    if job_config.compile.enable and job_config.compile.backend == "inductor":
        register_inductor_fallbacks()
    return then(model, WithoutTorchtitanCP(parallel_dims), job_config)


class UPipeTrainer(Trainer):
    """torchtitan's ``Trainer`` whose post-dataloading step lays out inputs and labels by the CP
    style's ``shard_positions`` (any style, FPDT's chunk-strided layout included) instead of by
    torchtitan's load balancer; everything else is torchtitan's loop. The loss stays right:
    torchtitan divides each rank's loss sum by the tokens of the whole sequence and sums
    gradients over the cp ranks (FSDP over dp_shard x cp, no division)."""

    def __init__(self, job_config: Any) -> None:
        token = _STYLE_LAYS_OUT_INPUTS.set(True)
        try:
            super().__init__(job_config)
        finally:
            _STYLE_LAYS_OUT_INPUTS.reset(token)
        self.cp_style = (
            applied_style(self.model_parts[0]) if self.parallel_dims.cp_enabled else None
        )

    def post_dataloading_process(
        self, input_dict: dict[str, Tensor], labels: Tensor
    ) -> tuple[Tensor, Tensor, dict[str, Tensor], dict[str, Any]]:
        if self.cp_style is None:
            return super().post_dataloading_process(input_dict, labels)
        inputs = input_dict["input"]
        extra_inputs = {key: value for key, value in input_dict.items() if key != "input"}
        mesh = self.parallel_dims.get_mesh("cp")
        index = self.cp_style.shard_positions(
            inputs.shape[1], mesh.get_local_rank(), mesh.size(), inputs.device
        )
        return inputs[:, index], labels[:, index], extra_inputs, {}  # RoPE: the style's layout


def register_train_specs() -> None:
    """``<family>_upipe`` for every model family this project registers that torchtitan ships a
    train spec for: torchtitan's spec with ``parallelize_with_style`` in front of its own
    parallelize function, and no pipelining."""
    for name in FAMILIES:
        spec: TrainSpec = get_train_spec(name)
        register_train_spec(
            name + SPEC_SUFFIX,
            dataclasses.replace(
                spec,
                parallelize_fn=functools.partial(parallelize_with_style, then=spec.parallelize_fn),
                pipelining_fn=None,
            ),
        )


CHECK_ONLY = "--check-only"
"""``python -m upipe_dtensor.integrations.torchtitan --check-only ARGS``: the checks alone."""


def check_job_config(job_config: Any) -> str:
    """Every check of the plug-in that needs no device or process group, from torchtitan's job
    config alone, as ``UPipeTrainer`` will see it (inputs laid out by the style): ConfigError in
    one line naming the key and a fix; else what will run, in words."""
    name, flavor = job_config.model.name, job_config.model.flavor
    if not (name.endswith(SPEC_SUFFIX) and name.removesuffix(SPEC_SUFFIX) in FAMILIES):
        specs = ", ".join(family + SPEC_SUFFIX for family in FAMILIES)
        return f"[model] name = {name!r} is not a spec of this plug-in ({specs}): nothing to check"
    args = get_train_spec(name).model_args.get(flavor)
    if args is None:
        return f"[model] flavor = {flavor!r} is not a flavor of {name}: torchtitan will say so"
    parallelism = job_config.parallelism
    cp = parallelism.context_parallel_degree
    try:
        refuse_tensor_parallelism(parallelism.tensor_parallel_degree)
        if cp <= 1:
            return f"{name} {flavor}: context_parallel_degree = {cp}: no CP style applied"
        style = checked_style(args, job_config, cp, lays_out_inputs=True)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        checked_style(args, job_config, cp, lays_out_inputs=False)
        balancer = "and so does the balancer -m torchtitan.train would cut them by"
    except ValueError:
        balancer = "(-m torchtitan.train, cutting them by its balancer, would refuse it)"
    return f"{name} {flavor}: {style} over cp {cp}, inputs laid out by the style, {balancer}"


def refuse_a_machine_torchtitan_cannot_train_on() -> None:
    """ConfigError where torchtitan 0.2.2 would take the device it cannot use: without an
    accelerator its device detection falls back to CUDA (``tools/utils.py``), and every rank
    then dies in ``torch.cuda.set_device``."""
    from torchtitan.tools import utils

    if utils.device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "torchtitan 0.2.2 trains on CUDA GPUs only (without one, its device set-up calls "
            f"torch.cuda.set_device and every rank fails), and this machine has none: {CHECK_ONLY} "
            "runs the plug-in's checks on any machine (docs/torchtitan.md)"
        )


def main(argv: list[str]) -> int:
    """``python -m upipe_dtensor.integrations.torchtitan``: torchtitan's ``main`` with
    ``UPipeTrainer`` (the specs are registered once, by this module's import), after the
    plug-in's checks: a bad option, geometry or layout is one line (once per launch) and exit 2
    before torchtitan sets up a device or a process group, on any machine. ``--check-only``: the
    checks alone, in one process, printing what would run."""
    check_only = CHECK_ONLY in argv
    args = [arg for arg in argv if arg != CHECK_ONLY]

    def check() -> None:
        from torchtitan.config import ConfigManager

        described = check_job_config(ConfigManager().parse_args(args))
        if check_only:
            if os.environ.get("RANK", "0") == "0":
                print(f"{described}; the checks passed (nothing trained: {CHECK_ONLY})")
            return
        refuse_a_machine_torchtitan_cannot_train_on()

    code = run_main(check)
    if code or check_only:
        return code
    from torchtitan.train import main as torchtitan_main

    torchtitan_main(UPipeTrainer)  # it parses sys.argv, which holds no --check-only here
    return 0


register_train_specs()
