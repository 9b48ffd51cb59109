"""What every model family's model shares for long contexts: the forward with checkpoint
groups, the chunked loss and one RoPE table per forward, seeded initialisation of sharded
weights, and the FLOPs per token.

A family's model subclasses its torchtitan generation's mixin of ``LongContextModel``
(``models.tt022.Decoder022``, ``models.tt030.Decoder030``: where the RoPE frequencies live, how
a block is called, how torchtitan initialises one) before torchtitan's model class, and keeps
its RoPE inverse frequencies (float64, (head_dim/2,)) where torchtitan's class keeps its table:
the CP style computes the angles of its shard's positions only (``kernels.rope``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from upipe_dtensor.kernels.rope import rope_table
from upipe_dtensor.memory.chunked_loss import chunked_cross_entropy_sum
from upipe_dtensor.runtime.sharded_compute import local_weight
from upipe_dtensor.runtime.torch_private import CHECKPOINT_PREFIX, is_fake

IGNORE_INDEX = -100
EVAL_CHUNK_TOKENS = 4096
"""Tokens per chunk of per-token losses when the plan chunks no loss."""


@dataclass(frozen=True)
class ForwardPlan:
    """How the long-context forward runs a model: settings the job owns, not the model.

    The parallelize step builds one (``train.parallelize``) and the job's ``ParallelModel`` passes
    it to every forward, so a model module carries no training-time side attributes and the same
    module runs plain (the default plan) or under the job's plan."""

    loss_chunk_tokens: int = 0
    """When > 0, ``forward(tokens, labels=...)`` fuses the output layer and cross-entropy over
    chunks of this many tokens (``[memory] chunked_loss``)."""
    checkpoint_groups: tuple = ()
    """Groups of blocks checkpointed together (``memory.offload.CheckpointGroup``), run in order;
    empty: the blocks run one by one (each may checkpoint itself)."""
    shard_rope: Callable[..., torch.Tensor] | None = None
    """The CP style's ``shard_rope``: ``forward`` computes this rank's RoPE table once, by the
    model's rule (``rope_table``) at the layout's positions or the given ones, and every block
    (and its recompute) reads that one table. None: each block derives it from the
    frequencies."""


PLAIN = ForwardPlan()
"""Torchtitan's forward: blocks one by one, whole logits, each block derives its RoPE table."""


class LongContextModel(nn.Module):
    """The long-context forward, shared by every family's model class (a mixin listed before
    torchtitan's model class); its torchtitan generation's mixin fills in the hooks below."""

    model_args: Any
    """The family's args the model was built from (``models.family.ModelFamily.args_class``)."""
    OUTPUT_WEIGHT: ClassVar[str]
    """The output layer's weight in the state dict."""

    def rope_frequencies(self) -> torch.Tensor:
        """The RoPE inverse frequencies (float64, (head_dim/2,)) the blocks read."""
        raise NotImplementedError

    def rope_table(self, positions: torch.Tensor) -> torch.Tensor:
        """The RoPE table at ``positions`` (``kernels.rope.rope_table``), from the frequencies."""
        return rope_table(self.rope_frequencies(), positions)

    def block_arguments(
        self, rope: torch.Tensor | None, attention_masks, positions: torch.Tensor | None
    ) -> tuple[tuple, dict[str, Any]]:
        """The arguments after ``h`` of every block's call: ``rope`` this shard's table
        (``ForwardPlan.shard_rope``; ``positions`` None then), or None for each attention to
        derive it from the frequencies."""
        raise NotImplementedError

    def reset_rope(self, device: torch.device) -> None:
        """Recompute the RoPE frequencies on ``device`` (after weights were materialised)."""
        raise NotImplementedError

    @staticmethod
    def init_block(block: nn.Module, device: torch.device) -> None:
        """torchtitan's initialisation of one block's weights (and buffers on ``device``)."""
        raise NotImplementedError

    def forward(
        self,
        tokens: torch.Tensor,
        attention_masks=None,
        positions: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        per_token: bool = False,
        plan: ForwardPlan = PLAIN,
    ) -> torch.Tensor:
        """Logits, as torchtitan's forward computes them; or, given ``labels``, the summed
        cross-entropy of the tokens
        (``per_token``: each token's, as (B, S) float32 with 0 where the label is ignored).

        ``plan`` says how to run it (the job's ``ForwardPlan``). The loss path runs inside the
        model's forward so the output weight is the gathered one under FSDP2; with the plan's
        ``loss_chunk_tokens`` (and always with ``per_token``) it never materialises the
        (tokens, vocab) logits.
        """
        h = self.tok_embeddings(tokens)
        rope = None
        if plan.shard_rope is not None:  # once per forward, not per block (nor per recompute)
            rope = plan.shard_rope(self.rope_table, tokens.shape[1], positions, tokens.device)
            positions = None
        args, kwargs = self.block_arguments(rope, attention_masks, positions)
        if plan.checkpoint_groups:
            for group in plan.checkpoint_groups:
                h = group(self.layers, h, *args, **kwargs)
        else:
            for layer in self.layers.values():
                h = layer(h, *args, **kwargs)
        h = self.norm(h)
        if isinstance(h, DTensor):  # tensor parallelism: this rank's sequence-parallel tokens
            return self._sequence_parallel_head(h, labels, per_token, plan)
        return self._head(h, self.output, self.output.weight, labels, per_token, plan)

    def _head(
        self,
        h: torch.Tensor,
        project: Callable[[torch.Tensor], torch.Tensor],
        weight: torch.Tensor,
        labels: torch.Tensor | None,
        per_token: bool,
        plan: ForwardPlan,
    ) -> torch.Tensor:
        """The logits of ``h`` by ``project`` (the output layer, of ``weight``), or the loss."""
        if labels is None:
            return project(h)
        if per_token:
            return self._token_losses(
                h, project, labels, plan.loss_chunk_tokens or EVAL_CHUNK_TOKENS
            )
        if plan.loss_chunk_tokens:
            return chunked_cross_entropy_sum(
                h,
                weight,
                labels,
                chunk_tokens=plan.loss_chunk_tokens,
                ignore_index=IGNORE_INDEX,
            )
        logits = project(h)
        return F.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

    def _sequence_parallel_head(
        self,
        h: DTensor,
        labels: torch.Tensor | None,
        per_token: bool,
        plan: ForwardPlan,
    ) -> torch.Tensor:
        """``_head`` under tensor parallelism (``models.tensor_parallel``): each rank on its
        sequence-parallel 1/tp of the tokens (``h``'s local rows, their labels) with the
        replicated output weight, whose gradient is this rank's partial sum (reduced over tp by
        DTensor and FSDP2); the loss sums are this rank's tokens', the logits and per-token
        losses the whole CP shard's (gathered over tp)."""
        mesh = h.device_mesh
        weight = local_weight(self.output.weight, partial_grad=True)
        if labels is not None:
            labels = labels.chunk(mesh.size(), dim=1)[mesh.get_local_rank()]
        project = functools.partial(F.linear, weight=weight)
        out = self._head(h.to_local(), project, weight, labels, per_token, plan)
        if labels is not None and not per_token:
            return out
        return DTensor.from_local(out, mesh, [Shard(1)], run_check=False).full_tensor()

    @staticmethod
    def _token_losses(
        h: torch.Tensor,
        project: Callable[[torch.Tensor], torch.Tensor],
        labels: torch.Tensor,
        chunk: int,
    ) -> torch.Tensor:
        """Each token's cross-entropy, ``chunk`` tokens at a time (for evaluation, no autograd)."""
        h_flat, labels_flat = h.flatten(0, 1), labels.flatten()
        losses = torch.empty(labels_flat.shape, dtype=torch.float32, device=h.device)
        for start in range(0, labels_flat.shape[0], chunk):
            logits = project(h_flat[start : start + chunk]).float()
            losses[start : start + chunk] = F.cross_entropy(
                logits,
                labels_flat[start : start + chunk],
                ignore_index=IGNORE_INDEX,
                reduction="none",
            )
        return losses.view(labels.shape)


def flops_per_token(model: nn.Module, args, seq_len: int) -> float:
    """Training FLOPs per token: 6 per non-embedding parameter plus causal attention.

    Causal attention does half of the 2 * 2 * S * d multiply-adds per head and token of full
    attention in forward, times 3 for forward + backward.
    """
    embedding = sum(p.numel() for p in model.tok_embeddings.parameters())
    dense = sum(p.numel() for p in model.parameters()) - embedding
    attention = 6 * args.n_layers * args.n_heads * args.resolved_head_dim * seq_len
    return 6 * dense + attention


def init_sharded_weights(model: LongContextModel, *, seed: int, device: torch.device) -> None:
    """Fill ``model``'s (possibly FSDP-sharded) parameters with the values torchtitan's
    ``init_weights`` gives the unsharded model for ``seed``, whatever the sharding.

    DTensor random init depends on the mesh (on CPU every rank draws its own shard), so a cp=2 run
    would start from other weights than cp=1. Here each part (embeddings/norm/output, then one
    block at a time) is materialised whole on ``device`` under its own seed, initialised by
    torchtitan's code, and only this rank's shard is kept; at most one block exists whole at once.
    Fake parameters (memory planning, shape tests) have no values to fill: only buffers are built.
    """
    if is_fake(next(model.parameters())):
        model.reset_rope(device)
        return
    with torch.device("meta"):
        twin = type(model)(model.model_args)
    blocks = twin.layers
    twin.layers = nn.ModuleDict()  # the top-level part: embeddings, final norm, output
    parts: list[tuple[nn.Module, nn.Module, Callable[[], None]]] = [
        (model, twin, lambda: twin.init_weights(buffer_device=device))
    ]
    parts += [
        (model.layers[name], block, functools.partial(model.init_block, block, device))
        for name, block in blocks.items()
    ]
    for index, (target, source, init) in enumerate(parts):
        source.to_empty(device=device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed * 1_000_003 + index)
            with torch.no_grad():
                init()
        _copy_shards(target, source)
        source.to_empty(device="meta")  # free the whole copy before the next part
    model.reset_rope(device)


@torch.no_grad()
def _copy_shards(target: nn.Module, source: nn.Module) -> None:
    """target.param <- this rank's shard of source.param, for every parameter of ``source``;
    and its buffers (a mixture of experts' expert bias and token counts; FSDP keeps buffers
    whole)."""
    # Checkpoint wrappers nest the block one level down; state dicts hide that, so do we.
    params = {name.replace(f"{CHECKPOINT_PREFIX}.", ""): p for name, p in target.named_parameters()}
    for name, full in source.named_parameters():
        param = params[name]
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank slices its own copy, no communication.
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.copy_(full)
    buffers = {name.replace(f"{CHECKPOINT_PREFIX}.", ""): b for name, b in target.named_buffers()}
    for name, full in source.named_buffers():
        if name in buffers and buffers[name].shape == full.shape:
            buffers[name].copy_(full)
