"""What the context-parallel styles need to know of a model family's attention module.

The styles replace a module's forward with one fused op (projections, the family's per-head
transform of Q and K, RoPE, attention and ``wo``), so they must know, per attention class, which
RoPE pairing it uses, which per-head function it applies before RoPE, and where it holds its
weights and its RoPE (``AttentionParts``: torchtitan 0.2.2's ``wq``/``wk``/``wv``/``wo`` on the
module with RoPE passed to its forward, or 0.3.0's ``qkv_linear`` (separate or fused), ``wo`` and
``rope`` parts). Each model family registers its attention class here (``models.family``); a
class that is not registered, or a module with a parameter the op would not use, is refused at
``parallelize_module`` instead of being computed without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from upipe_dtensor.kernels.rope import RopePairs
from upipe_dtensor.parallel.attention_op import AttentionWeights
from upipe_dtensor.parallel.qk_transform import QK_TRANSFORMS

_PROJECTIONS = ("wq", "wk", "wv", "wo")


@dataclass(frozen=True)
class AttentionParts:
    """Where an attention module holds the op's projections and its RoPE."""

    name: str
    """For messages: how the module holds them."""
    rope_in_module: bool
    """True: the module reads RoPE from its own ``rope`` part (``rope.cache``) and its forward
    is ``(x, attention_masks, positions)`` (torchtitan 0.3.0's ``GQAttention``); False: RoPE is
    passed to ``forward(x, freqs_cis, attention_masks, positions)`` (0.2.2's ``Attention``)."""

    def projections(self, module: nn.Module) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """wq, wk, wv, wo as (out_features, in_features) weights, rows grouped by head."""
        if not self.rope_in_module:
            return tuple(getattr(module, name).weight for name in _PROJECTIONS)
        qkv = module.qkv_linear
        if not hasattr(qkv, "wqkv"):
            return qkv.wq.weight, qkv.wk.weight, qkv.wv.weight, module.wo.weight
        # torchtitan's FusedQKVLinear: rows (n_kv_heads, heads_per_kv + 2, head_dim), the query
        # heads of each KV head, then its key and its value. Slices of the one weight (copies,
        # as its rows interleave: one layer's q/k/v weights, for this call), so autograd sums the
        # op's three gradients into it.
        per_kv, head_dim = qkv.heads_per_kv, qkv.head_dim
        rows = qkv.wqkv.weight.unflatten(0, (-1, per_kv + 2, head_dim))
        wq, wk, wv = rows.split([per_kv, 1, 1], dim=1)
        return (*(w.flatten(0, 2) for w in (wq, wk, wv)), module.wo.weight)

    def projection_weights(self, module: nn.Module) -> dict[str, Tensor]:
        """The module's projection parameters by name: what the op computes with."""
        names = (
            [f"{name}.weight" for name in _PROJECTIONS]
            if not self.rope_in_module
            else ["wo.weight"]
            + [
                f"qkv_linear.{name}.weight"
                for name in (("wqkv",) if hasattr(module.qkv_linear, "wqkv") else _PROJECTIONS[:3])
            ]
        )
        return {name: module.get_parameter(name) for name in names}

    def missing(self, module: nn.Module) -> list[str]:
        """The parts the op reads that ``module`` lacks."""
        parts = (
            ("wq", "wk", "wv", "wo") if not self.rope_in_module else ("qkv_linear", "wo", "rope")
        )
        return [a for a in (*parts, "n_heads", "n_kv_heads", "head_dim") if not hasattr(module, a)]


SEPARATE_PROJECTIONS = AttentionParts("wq/wk/wv/wo projections", rope_in_module=False)
"""torchtitan 0.2.2: ``wq``, ``wk``, ``wv``, ``wo`` on the module, RoPE passed to forward."""
QKV_LINEAR_AND_ROPE = AttentionParts(
    "qkv_linear (separate or fused), wo and rope parts", rope_in_module=True
)
"""torchtitan 0.3.0's ``GQAttention``: ``qkv_linear`` (``wq``/``wk``/``wv`` or fused ``wqkv``),
``wo``, and RoPE from its own ``rope`` part."""


@dataclass(frozen=True)
class AttentionKind:
    """One family's attention, as the fused op computes it."""

    family: str
    """The model family's name (``[model] name``), for messages."""
    rope_pairs: RopePairs
    """Which elements of a head RoPE rotates together (``kernels.rope``)."""
    qk_transform: str = ""
    """The per-head function of Q and K before RoPE (``qk_transform.QK_TRANSFORMS``), applied
    with the module's ``q_norm`` / ``k_norm`` weights when the module has them."""
    parts: AttentionParts = SEPARATE_PROJECTIONS
    """Where the module holds its projections and RoPE."""

    def __post_init__(self) -> None:
        if self.qk_transform and self.qk_transform not in QK_TRANSFORMS:
            raise ValueError(
                f"{self.family}: qk_transform {self.qk_transform!r} is not one of "
                f"{sorted(QK_TRANSFORMS)}; add its forward to parallel.qk_transform.QK_TRANSFORMS"
            )


KindOf = Callable[[nn.Module], AttentionKind]
"""A registered class's kind, read off one module: one class may serve several families
(torchtitan 0.3.0's ``GQAttention`` is Llama3's and Qwen3's, told apart by its ``rope`` part)."""

_KINDS: dict[type, KindOf] = {}


def register_attention_kind(cls: type[nn.Module], kind: AttentionKind | KindOf) -> None:
    """Let the context-parallel styles apply to ``cls`` modules, computed as ``kind`` says (or
    as ``kind(module)`` says, for a class whose modules differ)."""
    _KINDS[cls] = kind if callable(kind) else lambda module: kind


def attention_kind(module: nn.Module) -> AttentionKind:
    """The registered kind of ``module``'s class (or of the class it was before a style swapped
    in its context-parallel subclass); ValueError naming the registered classes otherwise."""
    cls = getattr(type(module), "_cp_base", type(module))
    for base in cls.__mro__:
        if base in _KINDS:
            return _KINDS[base](module)
    known = ", ".join(f"{c.__module__}.{c.__name__}" for c in _KINDS)
    raise ValueError(
        f"context-parallel attention styles apply to the attention modules of a registered model "
        f"family; {cls.__module__}.{cls.__name__} is not one (registered: {known}). Check the "
        f"plan's module path (e.g. 'layers.*.attention'), or register the family "
        f"(docs/design.md, 'Adding a model family')."
    )


def head_norms(module: nn.Module, kind: AttentionKind) -> tuple[nn.Module, nn.Module] | None:
    """The module's per-head Q and K norms when its family has them and this module uses them
    (Qwen3 built with ``qk_norm = False`` has none)."""
    if not kind.qk_transform:
        return None
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    return None if q_norm is None or k_norm is None else (q_norm, k_norm)


def attention_weights(module: nn.Module) -> AttentionWeights:
    """The op's weights of ``module``: its projections and, with QK-norm, the norms' weights."""
    kind = attention_kind(module)
    norms = head_norms(module, kind)
    projections = kind.parts.projections(module)
    if norms is None:
        return AttentionWeights(*projections)
    return AttentionWeights(*projections, norms[0].weight, norms[1].weight)


def qk_transform_of(module: nn.Module, kind: AttentionKind) -> tuple[str, float]:
    """The per-head Q/K transform of ``module`` (of ``kind``) and its epsilon (torch's default
    when the norm sets none), or ("", 0.0) when it applies none."""
    norms = head_norms(module, kind)
    if norms is None:
        return "", 0.0
    eps = norms[0].eps
    return kind.qk_transform, float(eps) if eps is not None else torch.finfo(
        norms[0].weight.dtype
    ).eps


def unused_parameters(module: nn.Module) -> list[str]:
    """The module's parameters the fused op would not use (a bias, another norm, ...)."""
    kind = attention_kind(module)
    used = set(kind.parts.projection_weights(module))
    if head_norms(module, kind) is not None:
        used |= {"q_norm.weight", "k_norm.weight"}
    return [name for name, _ in module.named_parameters() if name not in used]
