"""Each CP style's options: one frozen dataclass per style, its fields the style's own
``[parallelism]`` keys (name, type, default, a docstring under each), checked against the model's
heads and the mesh in one function (``StyleOptions.check``), and the values others need (the
head-axis degree, U, the sequence chunk) derived from plain numbers.

The config loader, its checks and ``--help``, ``parallelize``, the planner's search axes and the
torchtitan entry point (``registry.make_style``) all read a style's options from here, through
the registry; the style classes (``parallel.style``) generate their constructors' keyword
arguments from these fields, hold theirs and check them again at ``parallelize_module`` with the
numbers of the real module and mesh. A new option is one field here (and its check): the
constructor, ``repr``, the job key and ``--help`` follow. One spelling per default:
an option left unset (``None`` in Python, absent from a job file) takes its dataclass default,
whose meaning is written once, here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

from upipe_dtensor.parallel.head_schedule import make_head_schedule
from upipe_dtensor.parallel.layouts import chunk_count

FPDT_PAPER_CHUNK_TOKENS = 65536
"""The FPDT paper's chunk for Llama3-8B on 8 GPUs (``--ds-sequence-parallel-fpdt-chunk-size``)."""


@dataclass(frozen=True)
class Geometry:
    """The numbers a style's options are checked against: the model's heads, the CP mesh (C ranks,
    R of them on the ring axis), the tensor-parallel ranks the heads are split over and the
    sequence. None where not known yet (a style constructed before its model and mesh exist
    checks what it can)."""

    n_heads: int | None = None
    """The layer's query heads (every tensor-parallel rank's together)."""
    n_kv_heads: int | None = None
    cp_degree: int | None = None
    ring_degree: int | None = None
    seq_len: int | None = None
    tp_degree: int = 1
    """Tensor-parallel ranks: each runs the style on its n_heads / tp_degree heads."""


class OptionError(ValueError):
    """Options that cannot run: the message (the numbers and a fix) and the names at fault (option
    keys, ``Geometry`` fields, or ``cp_style`` when the style itself is one cause), so that a
    job's check can name where each was set."""

    def __init__(self, message: str, *names: str) -> None:
        super().__init__(message)
        self.names = names


SEARCHED = {"searched": True}
"""Field metadata of an option the planner's settings search varies for this style
(``planning.max_context``: U, the sequence chunks, overlapped stages)."""


@dataclass(frozen=True)
class StyleOptions:
    """The base of every style's options, and the options of a style that has none of its own.

    Subclasses add fields (their ``[parallelism]`` keys) and say, as class attributes, which axes
    of the mesh the style uses; ``check`` and the derived values below cover every style from
    those facts, and a subclass with a rule of its own extends ``check``.
    """

    head_axis: ClassVar[bool] = True
    """Exchanges heads by all-to-all over C / R ranks (False: a ring over all C ranks, nothing
    exchanged by head, any number of heads)."""
    ring_axis: ClassVar[bool] = False
    """Runs on a ring axis of R > 1 ranks times a head axis (2D): ``[parallelism] ring_degree``."""
    refusal_hints: ClassVar[dict[str, str]] = {}
    """Appended to the refusal of another style's option this style does not take, by key."""

    def head_degree(self, cp_degree: int, ring_degree: int = 1) -> int:
        """C_h, the ranks that exchange heads: C / R (1 without a head axis)."""
        return cp_degree // ring_degree if self.head_axis else 1

    def stage_heads(self, n_heads: int, head_degree: int) -> int:
        """U, the query heads one stage exchanges across the head axis: every head here."""
        return n_heads

    @property
    def chunk_tokens(self) -> int | None:
        """Tokens per global sequence chunk, earlier chunks' K/V in host memory (None: none)."""
        return None

    @property
    def overlaps_stages(self) -> bool:
        """Whether the next head stage's exchanges fly during this stage's attention."""
        return False

    def check(self, geometry: Geometry) -> None:
        """Every rule these options must meet on ``geometry``, each checked as soon as its numbers
        are known; ``OptionError`` naming the numbers, the names at fault and a fix."""
        ring = geometry.ring_degree or 1
        if ring > 1 and not self.ring_axis:
            raise OptionError(
                f"ring_degree = {ring} asks for a ring axis, but this style "
                + ("has none" if self.head_axis else "is already a ring over all C ranks")
                + ": set ring_degree = 1",
                "ring_degree",
                "cp_style",
            )
        chunk = self.chunk_tokens
        if chunk is not None and ring > 1:
            raise OptionError(
                f"sequence chunks (chunk_tokens = {chunk}) and a ring axis (ring_degree = "
                f"{ring}) cannot be combined: chunk the sequence on one node, or use a ring "
                "across nodes",
                "chunk_tokens",
                "ring_degree",
            )
        if chunk is not None and geometry.seq_len is not None and geometry.cp_degree is not None:
            try:
                chunk_count(geometry.seq_len, geometry.cp_degree, chunk)
            except ValueError as err:
                raise OptionError(
                    f"chunk_tokens = {chunk}: {err}",
                    "chunk_tokens",
                    "seq_len",
                    "cp_degree",
                ) from None
        tp = geometry.tp_degree
        if tp > 1 and geometry.n_heads is not None:
            n_kv = geometry.n_kv_heads or geometry.n_heads
            if geometry.n_heads % tp or n_kv % tp:
                raise OptionError(
                    f"tensor_parallel_degree = {tp} must divide the query heads "
                    f"({geometry.n_heads}) and the KV heads ({n_kv}): each tensor-parallel rank "
                    f"holds whole KV heads with their query heads; take a tensor_parallel_degree "
                    f"dividing {math.gcd(geometry.n_heads, n_kv)}",
                    "tensor_parallel_degree",
                    "n_heads",
                )
        if self.head_axis and None not in (geometry.n_heads, geometry.cp_degree):
            heads = self.head_degree(geometry.cp_degree, ring)
            local = geometry.n_heads // tp
            try:
                make_head_schedule(
                    local,
                    (geometry.n_kv_heads or geometry.n_heads) // tp,
                    heads,
                    self.stage_heads(local, heads),
                )
            except ValueError as err:
                on = f" (the {local} heads of each of {tp} tensor-parallel ranks)" if tp > 1 else ""
                raise OptionError(
                    f"{err}{on}",
                    "n_heads",
                    "heads_per_stage",
                    "cp_degree",
                    "ring_degree",
                    "cp_style",
                    *(("tensor_parallel_degree",) if tp > 1 else ()),
                ) from None

    def describe(self, n_heads: int, cp_degree: int, ring_degree: int = 1) -> str:
        """What the options add to the style's label in start-up lines and plans."""
        if ring_degree == 1:
            return ""
        return (
            f" on a ring of {ring_degree} x {self.head_degree(cp_degree, ring_degree)} head ranks"
        )


@dataclass(frozen=True)
class RingOptions(StyleOptions):
    """Ring attention: K/V passed around all C ranks; no options of its own."""

    head_axis = False


@dataclass(frozen=True)
class UlyssesOptions(StyleOptions):
    """DeepSpeed-Ulysses, every head in one stage; ``ring_degree`` > 1 is the USP hybrid."""

    ring_axis = True


@dataclass(frozen=True)
class UPipeOptions(StyleOptions):
    """UPipe: Ulysses a few heads at a time, optionally over sequence chunks (UPipe x FPDT)."""

    ring_axis = True

    heads_per_stage: int | None = field(default=None, metadata=SEARCHED)
    """U, query heads per stage across the head axis: a multiple of C / ring_degree that divides
    n_heads. Unset: U = C / ring_degree, one head per rank per stage (the least memory); U =
    n_heads is Ulysses."""
    chunk_tokens: int | None = field(default=None, metadata=SEARCHED)
    """UPipe x FPDT: each head stage over sequence chunks of this many tokens (after the
    all-to-all), earlier chunks' K/V in host memory (the longest contexts); unset runs each stage
    over the whole sequence. Not with ring_degree > 1."""
    overlap_stages: bool = field(default=False, metadata=SEARCHED)
    """Start the next head stage's all-to-alls before this stage's attention and wait for them
    just before their use (exchanges run while attention computes; one more stage's buffers in
    flight). Off by default: UPipe is the memory-first style, and the stage in flight about
    doubles the backward's working set (at 5M: 7.9 GiB per GPU) for at most +0.6% speed
    (planned: 128K, 0 at 5M; docs/measurements.md); ``plan --objective speed`` turns it on where
    it fits. No effect with sequence chunks, whose exchanges are waited for."""

    def stage_heads(self, n_heads: int, head_degree: int) -> int:
        return head_degree if self.heads_per_stage is None else self.heads_per_stage

    @property
    def overlaps_stages(self) -> bool:
        return self.overlap_stages and self.chunk_tokens is None

    def check(self, geometry: Geometry) -> None:
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise OptionError(
                f"chunk_tokens = {self.chunk_tokens}: give a positive number of tokens per "
                "sequence chunk, or leave chunk_tokens out for none",
                "chunk_tokens",
            )
        if self.heads_per_stage is not None and self.heads_per_stage < 1:
            raise OptionError(
                f"heads_per_stage = {self.heads_per_stage}: give a positive U (a multiple of the "
                "head-axis degree that divides n_heads), or leave it out for U = C",
                "heads_per_stage",
            )
        super().check(geometry)

    def describe(self, n_heads: int, cp_degree: int, ring_degree: int = 1) -> str:
        text = f" (U = {self.stage_heads(n_heads, self.head_degree(cp_degree, ring_degree))})"
        if self.chunk_tokens is not None:
            text += f" x FPDT in sequence chunks of {self.chunk_tokens:,} tokens"
        return text + super().describe(n_heads, cp_degree, ring_degree)


@dataclass(frozen=True)
class FPDTOptions(StyleOptions):
    """FPDT: Ulysses over sequence chunks, every head per chunk, as published."""

    refusal_hints = {
        "heads_per_stage": "FPDT runs all heads per chunk, as published; for UPipe x FPDT use "
        "cp_style = 'upipe' with chunk_tokens",
    }

    chunk_tokens: int | None = FPDT_PAPER_CHUNK_TOKENS
    """Tokens per sequence chunk after the all-to-all, earlier chunks' K/V waiting in host memory;
    at least the cp degree (the default is the FPDT paper's)."""

    def check(self, geometry: Geometry) -> None:
        if self.chunk_tokens is None or self.chunk_tokens < 1:
            raise OptionError(
                f"chunk_tokens = {self.chunk_tokens}: FPDT always runs in sequence chunks; give "
                f"a positive number of tokens (at least the cp degree), or leave it out for the "
                f"paper's {FPDT_PAPER_CHUNK_TOKENS}",
                "chunk_tokens",
            )
        super().check(geometry)

    def describe(self, n_heads: int, cp_degree: int, ring_degree: int = 1) -> str:
        return f" in sequence chunks of {self.chunk_tokens:,} tokens" + super().describe(
            n_heads, cp_degree, ring_degree
        )


def searched_options(options: type[StyleOptions]) -> tuple[str, ...]:
    """The option keys the planner's settings search varies, as the fields declare them."""
    return tuple(f.name for f in dataclasses.fields(options) if f.metadata.get("searched"))
