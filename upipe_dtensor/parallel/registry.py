"""The context-parallel styles by ``[parallelism] cp_style`` name: one table that the config
loader, its checks and ``--help``, ``parallelize``, the planner, ``gpu_check``, the tests and the
benchmarks read, so a new style is one ``register_style`` call instead of a string matched in ten
modules.

A ``StyleSpec`` names the class that runs a style and how start-up lines call it; the class
declares its options (``Options``, a ``parallel.style_options`` dataclass: the style's own
``[parallelism]`` keys with their types, defaults and meanings, one check, the derived values).
``make_style`` turns a ``cp_style`` and option values by those names into the checked style: the
entry point of the trainer and of a torchtitan plug-in alike. The built-ins are UPipe (2D on a
ring axis, UPipe x FPDT with sequence chunks), Ulysses, ring attention and FPDT.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from upipe_dtensor.memory.kept_attention import KeptAttention
from upipe_dtensor.parallel.style import (
    ContextParallelAttention,
    FPDTAttention,
    RingAttention,
    UlyssesAttention,
    UPipeAttention,
)
from upipe_dtensor.parallel.style_options import Geometry, OptionError, StyleOptions


@dataclass(frozen=True)
class StyleSpec:
    """One context-parallel style: its name, the class that runs it (which declares its
    options) and its label."""

    name: str
    """The ``[parallelism] cp_style`` value."""
    style: type[ContextParallelAttention]
    label: str
    """How start-up lines and plans name it ("Ulysses"); the options add their values."""

    @property
    def options(self) -> type[StyleOptions]:
        """The style's options dataclass (``style.Options``)."""
        return self.style.Options

    def takes(self, key: str) -> bool:
        """Whether ``key`` is one of the style's options."""
        return any(f.name == key for f in dataclasses.fields(self.options))

    def options_from(self, values: Mapping[str, Any]) -> StyleOptions:
        """The style's options from ``values`` by key, unset (None) ones at their defaults;
        ``OptionError`` for a key the style does not take, naming the styles that take it."""
        for key, value in values.items():
            if value is not None and not self.takes(key):
                takers = [repr(s.name) for s in STYLES.values() if s.takes(key)]
                owner = f"an option of cp_style {' and '.join(takers)}" if takers else "no option"
                hint = self.options.refusal_hints.get(key)
                raise OptionError(
                    f"{key} does not apply to cp_style {self.name!r} ({owner}); remove it"
                    + (f" ({hint})" if hint else ""),
                    key,
                )
        return self.options(**{key: value for key, value in values.items() if value is not None})

    def describe(
        self, options: StyleOptions, n_heads: int, cp_degree: int, ring_degree: int = 1
    ) -> str:
        """The configured attention in words, for start-up lines and plans."""
        return self.label + options.describe(n_heads, cp_degree, ring_degree)


STYLES: dict[str, StyleSpec] = {}
"""Every registered style by name, in registration order (the order errors list them in)."""


def register_style(spec: StyleSpec) -> StyleSpec:
    """Add ``spec`` to the table: config files, ``--help``, the trainer and the planner then
    accept its name and its options. An option key another style also declares must have the same
    type there (one key, one type in ``[parallelism]``)."""
    if spec.name in STYLES:
        raise ValueError(f"cp style {spec.name!r} is already registered")
    known = option_types()
    for key, kind in typing.get_type_hints(spec.options).items():
        if spec.takes(key) and known.get(key, kind) != kind:
            raise ValueError(
                f"cp style {spec.name!r} declares option {key} as {kind}, another style as "
                f"{known[key]}: one [parallelism] key has one type; rename it or match the type"
            )
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


def option_types() -> dict[str, Any]:
    """Every registered style's option key -> its type, in registration order."""
    types: dict[str, Any] = {}
    for spec in STYLES.values():
        hints = typing.get_type_hints(spec.options)
        types.update({f.name: hints[f.name] for f in dataclasses.fields(spec.options)})
    return types


def make_style(
    values: Mapping[str, Any] | object,
    geometry: Geometry = Geometry(),
    *,
    backend: str = "auto",
    kernel_device: str | None = None,
    keep_attention: KeptAttention | None = None,
    host_device: torch.device = torch.device("cpu"),
) -> ContextParallelAttention:
    """The style ``values`` names, checked: ``cp_style`` and that style's options by their
    ``[parallelism]`` names, from a mapping (any other key is refused) or a namespace such as a
    torchtitan job-config section (its attributes of those names are read). Unset (None) options
    take the style's defaults; every rule of the options is checked on ``geometry`` as far as it
    is given (``geometry.ring_degree``, when given, is the ring axis the style is made for, and
    ``parallelize_module`` checks the real module and mesh again). ``OptionError`` (a
    ValueError) names the numbers, the keys at fault and a fix.

    The trainer (``train.parallelize``) builds its style here, and so can a torchtitan plug-in
    from its own options: ``make_style({"cp_style": "upipe", "heads_per_stage": 8},
    Geometry(n_heads=32, n_kv_heads=8, cp_degree=8))``.
    """
    keys = ("cp_style", *option_types())
    if isinstance(values, Mapping):
        unknown = sorted(set(values) - set(keys))
        if unknown:
            raise OptionError(
                f"{', '.join(unknown)}: not a style option; the keys are cp_style and the "
                f"registered styles' options {list(keys[1:])}",
                *unknown,
            )
        given = dict(values)
    else:
        given = {key: getattr(values, key) for key in keys if hasattr(values, key)}
    if given.get("cp_style") is None:
        raise OptionError(f"name the style: cp_style, one of {list(STYLES)}", "cp_style")
    try:
        spec = style_spec(given.pop("cp_style"))
    except ValueError as err:
        raise OptionError(str(err), "cp_style") from None
    options = spec.options_from(given)
    options.check(geometry)
    settings = {"ring_degree": geometry.ring_degree, "host_device": host_device}
    return spec.style.from_options(
        options,
        **{name: value for name, value in settings.items() if name in spec.style.SETTINGS},
        backend=backend,
        kernel_device=kernel_device,
        keep_attention=keep_attention,
    )


def style_name(style: ContextParallelAttention) -> str:
    """The ``cp_style`` name of ``style``: the registered class nearest its own (a
    ``UPipeFPDTAttention``, the class ``UPipeAttention`` makes for ``chunk_tokens``, is
    "upipe")."""
    lineage = type(style).__mro__
    names = [name for name, spec in STYLES.items() if spec.style in lineage]
    if not names:
        raise ValueError(f"{type(style).__name__} is no registered style: {list(STYLES)}")
    return min(names, key=lambda name: lineage.index(STYLES[name].style))


register_style(StyleSpec("upipe", UPipeAttention, "UPipe"))
register_style(StyleSpec("ulysses", UlyssesAttention, "Ulysses"))
register_style(StyleSpec("ring", RingAttention, "ring attention"))
register_style(StyleSpec("fpdt", FPDTAttention, "FPDT"))
