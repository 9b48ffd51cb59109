"""UPipe (and Ulysses, ring, FPDT, UPipe x FPDT) inside torchtitan 0.3.0's own trainer.

A 0.3.0 job is a Python function returning a ``Trainer.Config``, named on the command line by
``--module M --config F``. This plug-in's ``config_registry`` has one for each of torchtitan's
Llama3 and Qwen3 config functions, by the same name: torchtitan's own config (model spec, data,
optimizer, schedule, checkpointing), built by torchtitan's function, as ``UPipeTrainer.Config``,
whose ``[upipe]`` section (``--upipe.cp_style``, ``--upipe.heads_per_stage``, ...) has this
project's ``[parallelism]`` names and checks::

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module upipe_dtensor.integrations.torchtitan --config llama3_8b \\
        --parallelism.context_parallel_degree 8 --upipe.heads_per_stage 8

``UPipeTrainer`` is torchtitan's ``Trainer`` (``config.build()`` builds it), changed at cp > 1:

- **parallelize**: the model spec's parallelize function first applies the style to every
  ``layers.*.attention`` over torchtitan's ``cp`` mesh, then the tiled MLP and RMSNorm if asked,
  then runs torchtitan's own (``parallelize_llama`` / ``parallelize_qwen3``: activation
  checkpointing, per-block compile, FSDP2 over ``dp_shard x cp``) with its CP skipped.
- **documents**: 0.3.0 trains packed documents: its data loaders give positions that restart
  at every document, from which its trainer builds a flex ``BlockMask`` (or varlen metadata).
  The styles take the document ids of the whole sequence instead, derived from the same
  positions (``data.documents.document_ids_from_positions``), and RoPE at those positions; so
  torchtitan's inner attention, which the styles replace, is made its maskless one and no
  ``BlockMask`` is built. A config whose attention masks nothing (torchtitan's
  ``ScaledDotProductAttention``: causal over the whole sequence) trains so with the style too.
- **layout**: torchtitan cuts each sequence by ``context_parallel_load_balancer`` when one feeds
  the style its layout (a mismatch is refused at start-up in one line naming the balancer that
  fits, as on 0.2.2); a layout no balancer produces (FPDT's chunk-strided one) is given by
  ordering each sequence so that torchtitan's contiguous cut hands every rank the style's tokens.

The config functions set two defaults: no load balancer (the contiguous layout of UPipe and
Ulysses; ring attention asks for ``"headtail"``), and ``spmd_backend = "partial_dtensor"``
(0.3.0's ``spmd_types`` and ``full_dtensor`` backends shard the attention layer's inner
attention themselves, which the styles replace; they are refused). What needs this project's
trainer is as on 0.2.2 (docs/torchtitan.md).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.config.override import derive
from torchtitan.models.common import FlexAttention, ScaledDotProductAttention, VarlenAttention
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from upipe_dtensor.data.documents import document_ids_from_positions
from upipe_dtensor.integrations.torchtitan.common import (
    UPipe,
    WithoutTorchtitanCP,
    applied_style,
    balancer_fits,
    check_load_balancer,
    fitting_balancers,
    make_cp_style,
    torchtitan_layout,
)
from upipe_dtensor.kernels.inductor import register_inductor_fallbacks
from upipe_dtensor.memory.rms_norm import apply_tiled_rms_norm
from upipe_dtensor.memory.tiled_mlp import apply_tiled_mlp
from upipe_dtensor.models.family import FAMILIES

__all__ = [
    "UPipe",
    "UPipeTrainer",
    "check_load_balancer",
    "main",
    "make_cp_style",
    "parallelize_with_style",
    "torchtitan_layout",
    "upipe_config",
    "upipe_config_functions",
]

logger = logging.getLogger(__name__)

_BACKEND = "partial_dtensor"
"""The spmd backend under which torchtitan's parallelize functions leave the attention to the
style (its CP is one wrapper of ``inner_attention``, skipped here)."""


def parallelize_with_style(
    model: nn.Module,
    *,
    parallel_dims: Any,
    training: Any,
    parallelism: Any,
    settings: Any,
    then: Callable[..., nn.Module],
    **options: Any,
) -> nn.Module:
    """A model spec's ``parallelize_fn``: the ``[upipe]`` ``settings``' style on every attention
    module over torchtitan's cp mesh, the tiled MLP and RMSNorm if asked, then ``then``
    (torchtitan's own parallelize function, with the remaining keyword ``options``:
    activation checkpointing, compile, FSDP) with its CP skipped."""
    tp = parallel_dims.tp if parallel_dims.tp_enabled else 1
    if parallel_dims.cp_enabled:
        seq_len, cp = training.seq_len, parallel_dims.cp
        attention = next(iter(model.layers.values())).attention
        style = make_cp_style(attention, settings, cp, seq_len, tp)
        balancer = parallelism.context_parallel_load_balancer
        if fitting_balancers(style, seq_len, cp):  # a balancer lays it out: it must be the job's
            check_load_balancer(style, balancer, seq_len, cp)
        parallelize_module(model, parallel_dims.get_mesh("cp"), {"layers.*.attention": style})
        logger.info(
            "[upipe] %s over cp %d, inputs laid out by %s",
            style,
            cp,
            f"balancer {balancer!r}"
            if balancer_fits(style, balancer, seq_len, cp)
            else "the style (no torchtitan balancer produces its layout)",
        )
    else:
        logger.info("[upipe] context_parallel_degree = 1: no CP style applied")
    if settings.tiled_mlp:
        apply_tiled_mlp(model, settings.mlp_tile_tokens)
    if settings.tiled_rms_norm:
        apply_tiled_rms_norm(model, settings.norm_tile_tokens)
    _drop_replaced_sharding(model, parallel_dims.cp_enabled, settings.tiled_mlp and tp > 1)
    compile_config = options["compile_config"]
    if compile_config.enable and compile_config.backend == "inductor":
        register_inductor_fallbacks()
    return then(
        model,
        parallel_dims=WithoutTorchtitanCP(parallel_dims),
        training=training,
        parallelism=parallelism,
        **options,
    )


def _drop_replaced_sharding(model: nn.Module, attention: bool, mlp: bool) -> None:
    """torchtitan's module-level sharding config of the modules this plug-in computes itself,
    dropped before ``model.parallelize`` (run under tensor or expert parallelism) wraps their
    forwards with it; their weights keep theirs. The styles' ``attention`` takes the arguments
    its adapter reads (torchtitan's wrapper renames them by the forward's signature) and, under
    tensor parallelism, its input as the block hands it on, sequence-parallel, gathering it
    itself (``runtime.sharded_compute``), as the tiled ``mlp`` does under tensor parallelism
    (torchtitan's config would all-gather the input, and reduce the output as its row-wise
    ``w2`` would)."""
    for block in model.layers.values():
        replaced = [block.attention] * attention
        if mlp and not getattr(block, "moe_enabled", False):  # an MoE keeps its EP layouts
            replaced.append(block.feed_forward)
        for module in replaced:
            module._sharding_config = None


def _takes_masks(spec: ModelSpec) -> bool:
    """Whether torchtitan's own attention in ``spec`` would mask documents (flex, varlen), or
    attends causally over the whole sequence (``ScaledDotProductAttention``, no masks)."""
    inner = spec.model.first_attention.inner_attention
    return isinstance(inner, (FlexAttention.Config, VarlenAttention.Config))


def _with_style(spec: ModelSpec, settings: Any) -> ModelSpec:
    """``spec`` whose parallelize function applies ``settings``' style first, with torchtitan's
    inner attention maskless (the styles replace it and take document ids, not its masks), and
    no pipelining (untested with the styles)."""
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return dataclasses.replace(
        spec,
        parallelize_fn=functools.partial(
            parallelize_with_style, settings=settings, then=spec.parallelize_fn
        ),
        pipelining_fn=None,
    )


class UPipeTrainer(Trainer):
    """torchtitan 0.3.0's ``Trainer`` running the ``[upipe]`` style (module docstring): its
    model spec's parallelize function applies the style, its post-dataloading step gives the
    style the document ids of the whole sequence and, for a layout no balancer produces, orders
    each sequence so that torchtitan's cut gives every rank the style's tokens. The loss needs
    no change: torchtitan divides each rank's loss sum by the valid tokens of the whole batch
    and FSDP sums gradients over ``dp_shard x cp``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        upipe: UPipe = field(default_factory=UPipe)  # type: ignore[valid-type]
        """The CP style torchtitan's trainer runs, with this project's [parallelism] names,
        checked as its job files are (parallel.registry.make_style)."""

    def __init__(self, config: Config) -> None:
        parallelism = config.parallelism
        # The style masks documents when torchtitan's own attention of the config would.
        self.documents = _takes_masks(config.model_spec)
        if parallelism.context_parallel_degree > 1:
            if parallelism.spmd_backend != _BACKEND:
                raise ValueError(
                    f"[parallelism] spmd_backend = {parallelism.spmd_backend!r} shards the "
                    "attention layer's inner attention itself, which the [upipe] style replaces; "
                    f"set --parallelism.spmd_backend {_BACKEND} (the plug-in's default)"
                )
            config.model_spec = _with_style(config.model_spec, config.upipe)
        super().__init__(config)
        self.cp_style = (
            applied_style(self.model_parts[0]) if self.parallel_dims.cp_enabled else None
        )
        # The order of a sequence's tokens that torchtitan cuts for the style (None: its own).
        self._order: Tensor | None = None
        if self.cp_style is not None:
            seq_len, cp = config.training.seq_len, self.parallel_dims.cp
            if not fitting_balancers(self.cp_style, seq_len, cp):
                # No torchtitan balancer produces the style's layout (FPDT's): torchtitan cuts
                # contiguously an order in which rank r's piece is the style's tokens.
                parallelism.context_parallel_load_balancer = None
                self._order = torch.cat(
                    [self.cp_style.shard_positions(seq_len, rank, cp) for rank in range(cp)]
                )

    def post_dataloading_process(
        self, input_dict: dict[str, Tensor], labels: Tensor
    ) -> tuple[Tensor, Tensor, dict[str, Any]]:
        if self.cp_style is None:
            return super().post_dataloading_process(input_dict, labels)
        if "positions" not in input_dict:
            raise ValueError(
                "the [upipe] style takes RoPE positions and documents from the data loader's "
                "per-document positions, and this batch has none; use one of torchtitan's text "
                "data loaders"
            )
        documents = document_ids_from_positions(input_dict["positions"])
        if self._order is not None:
            order = self._order.to(labels.device)
            input_dict = {key: value[:, order] for key, value in input_dict.items()}
            labels = labels[:, order]
        inputs, labels, extra = super().post_dataloading_process(input_dict, labels)
        if self.documents:  # the whole sequence's ids, as torchtitan's masks would separate
            extra["attention_masks"] = documents.to(inputs.device)
        return inputs, labels, extra


def upipe_config(config: Trainer.Config) -> UPipeTrainer.Config:
    """torchtitan's trainer ``config`` as ``UPipeTrainer.Config``: every field kept, the
    ``[upipe]`` section at its defaults, no load balancer, the partial_dtensor backend."""
    upipe = derive(config, UPipeTrainer.Config)
    upipe.parallelism.context_parallel_load_balancer = None
    upipe.parallelism.spmd_backend = _BACKEND
    return upipe


def _upipe_function(function: Callable[[], Trainer.Config]) -> Callable[[], UPipeTrainer.Config]:
    def config() -> UPipeTrainer.Config:
        return upipe_config(function())

    config.__name__ = config.__qualname__ = function.__name__
    config.__doc__ = f"torchtitan's ``{function.__name__}`` with the [upipe] section."
    return config


def upipe_config_functions() -> dict[str, Callable[[], UPipeTrainer.Config]]:
    """``name -> config function`` for torchtitan's config functions of every model family this
    project registers (``torchtitan.models.<family>.config_registry``'s ``<family>_*``)."""
    functions = {}
    for family in FAMILIES:
        module = f"torchtitan.models.{family}"
        if importlib.util.find_spec(module) is None:  # qwen3_moe: in torchtitan's qwen3
            continue
        registry = importlib.import_module(f"{module}.config_registry")
        for name in dir(registry):
            function = getattr(registry, name)
            if name.startswith(f"{family}_") and callable(function):
                functions[name] = _upipe_function(function)
    return functions


def main(argv: list[str]) -> int:
    """``python -m upipe_dtensor.integrations.torchtitan ARGS``: torchtitan's ``main``, which
    parses ``ARGS`` (``sys.argv``) and builds the trainer the ``--config`` function's config
    names (``UPipeTrainer`` for this plug-in's); the style's checks run when it is built."""
    from torchtitan.train import main as torchtitan_main

    torchtitan_main()
    return 0
