"""What a context-parallel style needs of an attention module: one record, read off the module by
one adapter per model family and torchtitan generation.

The styles replace an attention module's forward with one fused op (the Q/K/V projections, the
family's per-head transform of Q and K, RoPE, attention and the output projection), so they need
the module's parts, not its layout:

- ``AttentionLayer``: the module once: its head counts (the whole layer's), head size, softmax
  scale, RoPE pairing and per-head Q/K transform.
- ``ModuleWeights``: the parameters the op computes with, as the module holds them: whole, or
  this tensor-parallel rank's shards (DTensors, ``parallel.tensor_parallel``); Q/K/V separate or
  fused (``FusedQKV``).
- ``AttentionCall``: one call of the module's forward: its input, the document ids, and its RoPE:
  this shard's table when the model computed it once for the whole forward (passed by name), or
  how to compute it at given positions.

An ``AttentionAdapter`` reads the three off a module of the class it is registered for. The
adapters live with the model code (``models.tt022.attention``, ``models.tt030.attention``): this
package names no model's attributes and imports no model, so a new family or torchtitan
generation is one adapter and its registration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ParallelStyle

from upipe_dtensor.kernels.rope import RopePairs
from upipe_dtensor.parallel.qk_transform import QK_TRANSFORMS


@dataclass(frozen=True)
class AttentionLayer:
    """One attention module's shape, as the fused op computes it."""

    family: str
    """The model family's name, for messages."""
    n_heads: int
    """Query heads of the whole layer (every tensor-parallel rank's together)."""
    n_kv_heads: int
    head_dim: int
    scale: float
    """The softmax scale."""
    rope_pairs: RopePairs
    """Which elements of a head RoPE rotates together (``kernels.rope``)."""
    qk_transform: str = ""
    """The per-head function of Q and K before RoPE (``qk_transform.QK_TRANSFORMS``; "" for
    none), applied with ``ModuleWeights.q_norm`` / ``k_norm``."""
    qk_eps: float = 0.0
    """The epsilon of ``qk_transform``."""

    def __post_init__(self) -> None:
        if self.qk_transform and self.qk_transform not in QK_TRANSFORMS:
            raise ValueError(
                f"{self.family}: qk_transform {self.qk_transform!r} is not one of "
                f"{sorted(QK_TRANSFORMS)}; add its forward to parallel.qk_transform.QK_TRANSFORMS"
            )


class FusedQKV(NamedTuple):
    """Q, K and V projections held as one weight whose rows are grouped by KV head: each KV
    head's ``queries_per_kv`` query heads, then its key head, then its value head (torchtitan's
    fused layout). A tensor-parallel shard of whole rows groups holds whole KV heads."""

    weight: Tensor
    queries_per_kv: int


class ModuleWeights(NamedTuple):
    """The parameters the fused op computes with, as the module holds them (rows of the
    projections are heads of ``head_dim``; ``wo`` takes the heads as columns)."""

    qkv: tuple[Tensor, Tensor, Tensor] | FusedQKV
    """wq, wk, wv, or the fused weight."""
    wo: Tensor
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None
    """The per-head norms' weights, with the family's ``qk_transform``."""

    def parameters(self) -> list[Tensor]:
        """Every tensor here, once."""
        qkv = [self.qkv.weight] if isinstance(self.qkv, FusedQKV) else list(self.qkv)
        return [*qkv, self.wo, *(t for t in (self.q_norm, self.k_norm) if t is not None)]


class AttentionCall(NamedTuple):
    """One call of an attention module's forward, as its adapter reads the arguments."""

    x: Tensor
    """The module's input: (B, S/C, D), this rank's shard of the sequence."""
    document_ids: Tensor | None
    """(B, S) integer document ids of the whole sequence, or None (causal)."""
    rope_table: Tensor | None = None
    """This shard's RoPE table (``kernels.rope.rope_table``), computed once for the whole forward
    by the model and passed by name; None: computed here by ``rope_at``."""
    positions: Tensor | None = None
    """Global positions of this shard's tokens, (1, S/C) or (B, S/C); None: the style's layout.
    Given only without a table."""
    rope_at: Callable[[Tensor], Tensor] | None = None
    """positions -> RoPE table, the module's own rule (its frequencies or its position table);
    None when a table is given."""
    rope_positions: int | None = None
    """The positions ``rope_at`` reaches (a position table's rows); None: any."""


class AttentionAdapter:
    """How the context-parallel styles read the modules of one attention class: subclasses (one
    per model family and torchtitan generation) implement the methods below."""

    def check(self, module: nn.Module) -> None:
        """ValueError when ``module`` is of the class but not a form the fused op computes (a
        part missing, another inner attention); called once, when a style is applied."""

    def layer(self, module: nn.Module) -> AttentionLayer:
        raise NotImplementedError

    def weights(self, module: nn.Module) -> ModuleWeights:
        raise NotImplementedError

    def call(self, module: nn.Module, *args: object, **kwargs: object) -> AttentionCall:
        """The arguments of one ``module.forward(*args, **kwargs)`` call."""
        raise NotImplementedError

    def tensor_parallel_plan(self, module: nn.Module) -> dict[str, ParallelStyle]:
        """torchtitan's tensor-parallel layout of ``module``'s parameters (``parallel.
        tensor_parallel``), by submodule name: the plan ``parallelize_module`` applies over a
        ``tp`` mesh before the context-parallel style."""
        raise NotImplementedError


_ADAPTERS: dict[type, AttentionAdapter] = {}


def register_attention_adapter(cls: type[nn.Module], adapter: AttentionAdapter) -> None:
    """Let the context-parallel styles apply to ``cls`` modules, read through ``adapter``."""
    _ADAPTERS[cls] = adapter


def attention_adapter(module: nn.Module) -> AttentionAdapter:
    """The adapter of ``module``'s class (or of the class it was before a style swapped in its
    context-parallel subclass); ValueError naming the registered classes otherwise."""
    cls = getattr(type(module), "_cp_base", type(module))
    for base in cls.__mro__:
        if base in _ADAPTERS:
            return _ADAPTERS[base]
    known = ", ".join(f"{c.__module__}.{c.__name__}" for c in _ADAPTERS) or "none"
    raise ValueError(
        f"context-parallel attention styles apply to the attention modules of a registered model "
        f"family; {cls.__module__}.{cls.__name__} is not one (registered: {known}). Check the "
        f"plan's module path (e.g. 'layers.*.attention'), or register the family's attention "
        f"adapter (docs/design.md, 'Adding a model family')."
    )


def unused_parameters(module: nn.Module, weights: ModuleWeights) -> list[str]:
    """The module's parameters the fused op would not compute with (a bias, another norm, ...)."""
    used = {id(t) for t in weights.parameters()}
    return [name for name, param in module.named_parameters() if id(param) not in used]


def norm_epsilon(norm: nn.Module) -> float:
    """A per-head norm's epsilon, as its forward uses it (torch's default for the weight's dtype
    when the norm sets none)."""
    eps = norm.eps
    return float(eps) if eps is not None else torch.finfo(norm.weight.dtype).eps
