"""torchtitan's Llama3, with an explicit ``head_dim`` and FFN size, and no RoPE position table.

torchtitan 0.2.2 derives head_dim as dim // n_heads; the UPipe paper's 32B model (a Qwen3-32B
shape on the Llama3 architecture) has dim 5120 but 64 heads of 128 (64 * 128 != 5120). It also
derives the FFN size from dim, multiple_of and ffn_dim_multiplier, while a Hugging Face
config.json states ``intermediate_size``. ``Llama3`` subclasses torchtitan's ``Transformer`` and
only resizes the attention and MLP projections when those differ; blocks, init and forward are
torchtitan's. Its ``freqs_cis`` buffer holds the float64 inverse frequencies instead of a
max_seq_len-row complex table: the CP style computes the angles of its shard's positions only
(``kernels.rope``). So its attention runs under a CP style, which ``parallelize_llama`` always
applies (cp = 1 included); torchtitan's own attention expects the table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import FeedForward, Transformer

from upipe_dtensor.kernels.rope import rope_frequencies
from upipe_dtensor.memory.chunked_loss import chunked_cross_entropy_sum

IGNORE_INDEX = -100
EVAL_CHUNK_TOKENS = 4096
"""Tokens per chunk of per-token losses when [memory] loss_chunk_tokens is not set."""


@dataclass
class Llama3Args(TransformerModelArgs):
    head_dim: int = 0
    """Per-head size; 0 means dim // n_heads (torchtitan's rule)."""
    ffn_dim: int = 0
    """SwiGLU hidden size; 0 means torchtitan's rule (from dim, multiple_of, ffn_dim_multiplier)."""

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def resolved_ffn_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        with torch.device("meta"):  # torchtitan's own rule, read off its module
            mlp = FeedForward(self.dim, 4 * self.dim, self.multiple_of, self.ffn_dim_multiplier)
        return mlp.w1.out_features


FLAVORS: dict[str, Llama3Args] = {
    # Small enough for a CPU laptop, GQA (2 query heads per KV head) so CP paths are exercised.
    "debugmodel": Llama3Args(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, rope_theta=500000
    ),
    "8B": Llama3Args(
        **{
            f.name: getattr(llama3_args["8B"], f.name)
            for f in dataclasses.fields(TransformerModelArgs)
        }
    ),
    # The UPipe paper's "32B": 64 layers, dim 5120, 64 query / 8 KV heads of 128, FFN 25600.
    "32B": Llama3Args(
        dim=5120,
        n_layers=64,
        n_heads=64,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim_multiplier=1.875,
        multiple_of=1024,
        rope_theta=1_000_000,
        vocab_size=128256,
    ),
}


class Llama3(Transformer):
    """torchtitan ``Transformer`` with ``args.resolved_head_dim`` and ``args.resolved_ffn_dim``."""

    def __init__(self, args: Llama3Args) -> None:
        super().__init__(args)
        head_dim, ffn_dim = args.resolved_head_dim, args.resolved_ffn_dim
        n_kv = args.n_kv_heads or args.n_heads
        for block in self.layers.values():
            if head_dim != args.dim // args.n_heads:
                attention = block.attention
                attention.head_dim = head_dim
                attention.wq = nn.Linear(args.dim, args.n_heads * head_dim, bias=False)
                attention.wk = nn.Linear(args.dim, n_kv * head_dim, bias=False)
                attention.wv = nn.Linear(args.dim, n_kv * head_dim, bias=False)
                attention.wo = nn.Linear(args.n_heads * head_dim, args.dim, bias=False)
            mlp = block.feed_forward
            if mlp.w1.out_features != ffn_dim:
                mlp.w1 = nn.Linear(args.dim, ffn_dim, bias=False)
                mlp.w2 = nn.Linear(ffn_dim, args.dim, bias=False)
                mlp.w3 = nn.Linear(args.dim, ffn_dim, bias=False)

    loss_chunk_tokens: int = 0
    """When > 0, ``forward(tokens, labels=...)`` fuses the output layer and cross-entropy over
    chunks of this many tokens (set by the parallelize step from ``[memory] chunked_loss``)."""
    checkpoint_groups: list = []
    """Groups of blocks checkpointed together (``memory.offload.CheckpointGroup``), run in order
    by ``forward``; empty: the blocks run one by one (each may checkpoint itself)."""
    shard_rope: Callable[[torch.Tensor, int, torch.Tensor | None], torch.Tensor] | None = None
    """The CP style's ``shard_rope`` (set by the parallelize step): ``forward`` computes this
    rank's RoPE table once, from ``freqs_cis`` and the positions, and every block (and its
    recompute) reads that one table. None: each block derives it from ``freqs_cis``."""

    def forward(
        self,
        tokens: torch.Tensor,
        attention_masks=None,
        positions: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        per_token: bool = False,
    ) -> torch.Tensor:
        """Logits, as torchtitan's forward computes them; or, given ``labels``, the summed
        cross-entropy of the tokens
        (``per_token``: each token's, as (B, S) float32 with 0 where the label is ignored).

        The loss path runs inside the model's forward so the output weight is the gathered one
        under FSDP2; with ``loss_chunk_tokens`` (and always with ``per_token``) it never
        materialises the (tokens, vocab) logits.
        """
        h = self.tok_embeddings(tokens)
        rope = self.freqs_cis
        if self.shard_rope is not None:  # once per forward, not per block (nor per recompute)
            rope, positions = self.shard_rope(self.freqs_cis, tokens.shape[1], positions), None
        if self.checkpoint_groups:
            for group in self.checkpoint_groups:
                h = group(
                    self.layers, h, rope, attention_masks=attention_masks, positions=positions
                )
        else:
            for layer in self.layers.values():
                h = layer(h, rope, attention_masks=attention_masks, positions=positions)
        h = self.norm(h)
        if labels is None:
            return self.output(h)
        if per_token:
            return self._token_losses(h, labels)
        if self.loss_chunk_tokens:
            return chunked_cross_entropy_sum(
                h,
                self.output.weight,
                labels,
                chunk_tokens=self.loss_chunk_tokens,
                ignore_index=IGNORE_INDEX,
            )
        logits = self.output(h)
        return F.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

    def _token_losses(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each token's cross-entropy, a chunk of tokens at a time (for evaluation, no autograd)."""
        chunk = self.loss_chunk_tokens or EVAL_CHUNK_TOKENS
        h_flat, labels_flat = h.flatten(0, 1), labels.flatten()
        losses = torch.empty(labels_flat.shape, dtype=torch.float32, device=h.device)
        for start in range(0, labels_flat.shape[0], chunk):
            logits = self.output(h_flat[start : start + chunk]).float()
            losses[start : start + chunk] = F.cross_entropy(
                logits,
                labels_flat[start : start + chunk],
                ignore_index=IGNORE_INDEX,
                reduction="none",
            )
        return losses.view(labels.shape)

    def _precompute_freqs_cis(self) -> torch.Tensor:
        """The (head_dim/2,) float64 inverse frequencies, not torchtitan's position table."""
        args = self.model_args
        return rope_frequencies(args.resolved_head_dim, args.rope_theta, args.rope_scaling_args)


def build_llama3(flavor: str, *, seq_len: int, vocab_size: int | None = None) -> Llama3:
    """The flavor's model for ``seq_len``-token sequences (build under a meta device for 8B+)."""
    if flavor not in FLAVORS:
        raise ValueError(f"unknown model flavor {flavor!r}; choose one of {sorted(FLAVORS)}")
    args = dataclasses.replace(FLAVORS[flavor], max_seq_len=seq_len)
    if vocab_size is not None:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    return Llama3(args)


def flops_per_token(model: nn.Module, args: Llama3Args, seq_len: int) -> float:
    """Training FLOPs per token: 6 per non-embedding parameter plus causal attention.

    Causal attention does half of the 2 * 2 * S * d multiply-adds per head and token of full
    attention in forward, times 3 for forward + backward.
    """
    embedding = sum(p.numel() for p in model.tok_embeddings.parameters())
    dense = sum(p.numel() for p in model.parameters()) - embedding
    attention = 6 * args.n_layers * args.n_heads * args.resolved_head_dim * seq_len
    return 6 * dense + attention


def init_sharded_weights(model: Llama3, *, seed: int, device: torch.device) -> None:
    """Fill ``model``'s (possibly FSDP-sharded) parameters with the values torchtitan's
    ``init_weights`` gives the unsharded model for ``seed``, whatever the sharding.

    DTensor random init depends on the mesh (on CPU every rank draws its own shard), so a cp=2 run
    would start from other weights than cp=1. Here each part (embeddings/norm/output, then one
    block at a time) is materialised whole on ``device`` under its own seed, initialised by
    torchtitan's code, and only this rank's shard is kept; at most one block exists whole at once.
    Fake parameters (memory planning, shape tests) have no values to fill: only buffers are built.
    """
    if is_fake(next(model.parameters())):
        model.freqs_cis = model._precompute_freqs_cis().to(device)
        return
    with torch.device("meta"):
        twin = Llama3(model.model_args)
    blocks = twin.layers
    twin.layers = nn.ModuleDict()  # the top-level part: embeddings, final norm, output
    parts: list[tuple[nn.Module, nn.Module, Callable[[], None]]] = [
        (model, twin, lambda: twin.init_weights(buffer_device=device))
    ]
    parts += [(model.layers[name], block, block.init_weights) for name, block in blocks.items()]
    for index, (target, source, init) in enumerate(parts):
        source.to_empty(device=device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed * 1_000_003 + index)
            with torch.no_grad():
                init()
        _copy_shards(target, source)
        source.to_empty(device="meta")  # free the whole copy before the next part
    model.freqs_cis = model._precompute_freqs_cis().to(device)


@torch.no_grad()
def _copy_shards(target: nn.Module, source: nn.Module) -> None:
    """target.param <- this rank's shard of source.param, for every parameter of ``source``."""
    # Checkpoint wrappers nest the block one level down; state dicts hide that, so do we.
    params = {
        name.replace(f"{_CHECKPOINT_PREFIX}.", ""): p for name, p in target.named_parameters()
    }
    for name, full in source.named_parameters():
        param = params[name]
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank slices its own copy, no communication.
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.copy_(full)
