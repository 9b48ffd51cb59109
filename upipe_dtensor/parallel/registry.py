"""The context-parallel styles by ``[parallelism] cp_style`` name: one table that the config
checks, ``parallelize``, the planner, ``gpu_check``, the tests and the benchmarks read, so a new
style is one ``register_style`` call instead of a string matched in ten modules.

A ``StyleSpec`` says which class runs the style, which of the shared options it takes (heads per
stage, a ring axis, sequence chunks, overlapped stages) and how it names itself; everything else
(the constructor from a job's settings, the head-axis degree, the start-up text) follows from
those facts. The built-ins are UPipe (2D on a ring axis, UPipe x FPDT with sequence chunks),
Ulysses, ring attention and FPDT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from upipe_dtensor.memory.kept_attention import KeptAttention
from upipe_dtensor.parallel.style import (
    ContextParallelAttention,
    FPDTAttention,
    RingAttention,
    UlyssesAttention,
    UPipeAttention,
)

if TYPE_CHECKING:  # config imports this module; a runtime import back would be a cycle
    from upipe_dtensor.config.schema import Parallelism


@dataclass(frozen=True)
class StyleSpec:
    """One context-parallel style: its class and the options and axes it has."""

    name: str
    """The ``[parallelism] cp_style`` value."""
    style: type[ContextParallelAttention]
    label: str
    """How start-up lines and plans name it ("Ulysses"); UPipe adds its U."""
    head_axis: bool = True
    """Exchanges heads by all-to-all over C / ring_degree ranks; False: a ring over all C ranks
    (nothing exchanged by head, any number of heads)."""
    ring_axis: bool = False
    """Takes ``ring_degree`` > 1: a ring across nodes times a head axis inside one (2D)."""
    stage_heads: bool = False
    """Takes ``heads_per_stage`` (UPipe's U); otherwise every head runs in one stage."""
    overlap_stages: bool = False
    """Takes ``overlap_stages``: the next stage's exchanges fly during this stage's attention."""
    chunks: Literal["never", "optional", "always"] = "never"
    """Sequence chunks with earlier K/V in host memory: none, on request (``fpdt_chunk_tokens``
    > 0, "x FPDT"), or always (``Parallelism.chunk_tokens`` resolves 0 to the FPDT paper's)."""
    heads_per_stage_hint: str = ""
    """Appended to the error for a heads_per_stage this style does not take."""

    def make(
        self,
        *,
        heads_per_stage: int | None = None,
        ring_degree: int | None = None,
        chunk_tokens: int | None = None,
        overlap_stages: bool = True,
        backend: str = "auto",
        kernel_device: str | None = None,
        keep_attention: KeptAttention | None = None,
        host_device: torch.device = torch.device("cpu"),
    ) -> ContextParallelAttention:
        """The style with the options it takes; an option it does not take must be left unset
        (ValueError), so a caller never believes a setting ran that did not."""
        given = {
            "heads_per_stage": (heads_per_stage, heads_per_stage is not None, self.stage_heads),
            "ring_degree": (ring_degree, ring_degree not in (None, 1), self.ring_axis),
            "chunk_tokens": (chunk_tokens, chunk_tokens is not None, self.chunks != "never"),
            "overlap_stages": (overlap_stages, not overlap_stages, self.overlap_stages),
        }
        refused = [key for key, (_, set_, taken) in given.items() if set_ and not taken]
        if refused:
            raise ValueError(f"cp style {self.name!r} does not take {', '.join(refused)}")
        if self.chunks == "always" and chunk_tokens is None:
            raise ValueError(f"cp style {self.name!r} runs in sequence chunks: pass chunk_tokens")
        options = {key: value for key, (value, _, taken) in given.items() if taken}
        if self.chunks != "never":
            options["host_device"] = host_device
        return self.style(
            **options, backend=backend, kernel_device=kernel_device, keep_attention=keep_attention
        )

    def build(
        self,
        parallelism: Parallelism,
        n_heads: int,
        *,
        backend: str,
        kernel_device: str | None,
        keep_attention: KeptAttention | None,
        host_device: torch.device,
    ) -> ContextParallelAttention:
        """The style a job's ``[parallelism]`` asks for, from its resolved values (U, ring degree,
        sequence chunks), so its layout and kernels are known at once."""
        return self.make(
            heads_per_stage=parallelism.stage_heads(n_heads) if self.stage_heads else None,
            ring_degree=parallelism.ring_degree if self.ring_axis else None,
            chunk_tokens=parallelism.chunk_tokens or None,
            overlap_stages=parallelism.overlap_stages if self.overlap_stages else True,
            backend=backend,
            kernel_device=kernel_device,
            keep_attention=keep_attention,
            host_device=host_device,
        )

    def describe(self, parallelism: Parallelism, n_heads: int) -> str:
        """The configured attention in words, for start-up lines and plans."""
        text = self.label
        if self.stage_heads:
            text += f" (U = {parallelism.stage_heads(n_heads)})"
        if parallelism.chunk_tokens:
            fpdt = "x FPDT " if self.chunks == "optional" else ""
            text += f" {fpdt}in sequence chunks of {parallelism.chunk_tokens:,} tokens"
        ring, heads = parallelism.ring_degree, parallelism.head_degree
        if ring > 1:
            text += f" on a ring of {ring} x {heads} head ranks"
        return text


STYLES: dict[str, StyleSpec] = {}
"""Every registered style by name, in registration order (the order errors list them in)."""


def register_style(spec: StyleSpec) -> StyleSpec:
    """Add ``spec`` to the table: config files, the trainer and the planner then accept its
    name."""
    if spec.name in STYLES:
        raise ValueError(f"cp style {spec.name!r} is already registered")
    STYLES[spec.name] = spec
    return spec


def style_names() -> tuple[str, ...]:
    """The registered names, in registration order."""
    return tuple(STYLES)


def style_spec(name: str) -> StyleSpec:
    """The spec of ``name``; ValueError listing the registered names when there is none."""
    if name not in STYLES:
        raise ValueError(f"cp_style = {name!r} is not one of {list(STYLES)}")
    return STYLES[name]


register_style(
    StyleSpec(
        "upipe",
        UPipeAttention,
        "UPipe",
        ring_axis=True,
        stage_heads=True,
        overlap_stages=True,
        chunks="optional",
    )
)
register_style(StyleSpec("ulysses", UlyssesAttention, "Ulysses", ring_axis=True))
register_style(StyleSpec("ring", RingAttention, "ring attention", head_axis=False))
register_style(
    StyleSpec(
        "fpdt",
        FPDTAttention,
        "FPDT",
        chunks="always",
        heads_per_stage_hint=" (FPDT runs all heads per chunk, as published; for UPipe x FPDT use "
        "cp_style = 'upipe' with fpdt_chunk_tokens > 0)",
    )
)
