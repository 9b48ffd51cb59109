"""What the context-parallel styles need to know of a model family's attention module.

The styles replace a module's forward with one fused op (projections, the family's per-head
transform of Q and K, RoPE, attention and ``wo``), so they must know, per attention class, which
RoPE pairing it uses and which per-head function it applies before RoPE. Each model family
registers its attention class here (``models.family``); a class that is not registered, or a
module with a parameter the op would not use, is refused at ``parallelize_module`` instead of
being computed without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from upipe_dtensor.kernels.rope import RopePairs
from upipe_dtensor.parallel.attention_op import AttentionWeights
from upipe_dtensor.parallel.qk_transform import QK_TRANSFORMS

_PROJECTIONS = ("wq", "wk", "wv", "wo")


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

    def __post_init__(self) -> None:
        if self.qk_transform and self.qk_transform not in QK_TRANSFORMS:
            raise ValueError(
                f"{self.family}: qk_transform {self.qk_transform!r} is not one of "
                f"{sorted(QK_TRANSFORMS)}; add its forward to parallel.qk_transform.QK_TRANSFORMS"
            )


_KINDS: dict[type, AttentionKind] = {}


def register_attention_kind(cls: type[nn.Module], kind: AttentionKind) -> None:
    """Let the context-parallel styles apply to ``cls`` modules, computed as ``kind`` says."""
    _KINDS[cls] = kind


def attention_kind(module: nn.Module) -> AttentionKind:
    """The registered kind of ``module``'s class (or of the class it was before a style swapped
    in its context-parallel subclass); ValueError naming the registered classes otherwise."""
    cls = getattr(type(module), "_cp_base", type(module))
    for base in cls.__mro__:
        if base in _KINDS:
            return _KINDS[base]
    known = ", ".join(f"{c.__module__}.{c.__name__} ({k.family})" for c, k in _KINDS.items())
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
    norms = head_norms(module, attention_kind(module))
    projections = (getattr(module, name).weight for name in _PROJECTIONS)
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
    used = {f"{name}.weight" for name in _PROJECTIONS}
    if head_norms(module, attention_kind(module)) is not None:
        used |= {"q_norm.weight", "k_norm.weight"}
    return [name for name, _ in module.named_parameters() if name not in used]
