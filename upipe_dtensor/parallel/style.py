"""Context-parallel styles for the attention modules of a registered model family (an adapter in
``parallel.attention_interface``: torchtitan's Llama3 and Qwen3 attention, registered by
``models``): UPipe, Ulysses, ring attention and FPDT.

Applied with ``parallelize_module(model, cp_mesh, {"layers.*.attention": UPipeAttention()})``.
Every style exposes ``shard_positions(seq_len, cp_rank,
cp_size)``, the tokens each rank feeds in the order its module expects, and accepts a document
mask; all of them run through the same all-to-all, kernels, ring and host-memory pieces. Unlike
PyTorch's tensor-parallel styles, the parameters stay as they are, replicated over the CP mesh:
the style changes how activations are laid out, not how weights are, so ``fully_shard`` applied
afterwards owns the parameters as usual. A module already tensor-parallel (its projections
sharded over a ``tp`` mesh as torchtitan shards them) runs the style on its own heads
(``parallel.tensor_parallel``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from upipe_dtensor.kernels.backends import BACKENDS, CUDA_BACKENDS, check_kernel_limits
from upipe_dtensor.memory.kept_attention import KeptAttention
from upipe_dtensor.parallel.attention_interface import (
    AttentionAdapter,
    AttentionCall,
    AttentionLayer,
    attention_adapter,
    unused_parameters,
)
from upipe_dtensor.parallel.attention_op import AttentionParams, AttentionWeights
from upipe_dtensor.parallel.fpdt_attention import fpdt_attention, fpdt_qkv_attention
from upipe_dtensor.parallel.layouts import (
    chunk_count,
    chunked_positions,
    contiguous_positions,
    two_d_positions,
)
from upipe_dtensor.parallel.staged_attention import qkv_attention, staged_attention
from upipe_dtensor.parallel.style_options import (
    FPDTOptions,
    Geometry,
    RingOptions,
    StyleOptions,
    UlyssesOptions,
    UPipeOptions,
)
from upipe_dtensor.parallel.tensor_parallel import local_weights, tensor_parallel_mesh
from upipe_dtensor.runtime.host_store import HostMemory
from upipe_dtensor.runtime.sharded_compute import gathered_input, reduced_output


@dataclass(frozen=True)
class _Axes:
    """The CP mesh as the attention ops see it: a head axis (all-to-all) and a ring axis (p2p)."""

    head_group: str
    head_degree: int
    ring_group: str
    ring_degree: int
    cp_rank: int
    """Rank in the whole CP group, ring-major: ring_rank * head_degree + head_rank."""

    @property
    def cp_degree(self) -> int:
        return self.head_degree * self.ring_degree


_TWO_D_NAMES = ("cp_ring", "cp_heads")


def _group_name(mesh: DeviceMesh, dim: int) -> str:
    return mesh.get_group(dim).group_name if mesh.size(dim) > 1 else ""


_KERNEL_ARGUMENTS: dict[str, object] = {
    "backend": "auto",
    "kernel_device": None,
    "keep_attention": None,
}
"""Every style's kernel arguments and their defaults (``ContextParallelAttention._configure``)."""


class ContextParallelAttention(ParallelStyle):
    """The base of every context-parallel attention style: module checks, the mesh, positions,
    RoPE and documents. Annotate with this type where any CP style will do.

    Subclasses declare their options (``Options``, a ``parallel.style_options`` dataclass: the
    style's ``[parallelism]`` keys, checked in one function), and say how the mesh maps to head
    and ring axes (``_axes``), which tokens a rank holds (``shard_positions``) and which op runs
    the attention (``_op``).
    """

    Options: ClassVar[type[StyleOptions]] = StyleOptions
    """The options this style declares, once: its constructor's keyword arguments, its
    ``[parallelism]`` keys (``parallel.registry`` reads them from here); ``options`` holds this
    instance's."""
    SETTINGS: ClassVar[dict[str, object]] = {}
    """The constructor's other arguments of this style, besides its options and the kernels'
    (``backend``, ``kernel_device``, ``keep_attention``): name -> default."""

    def __init_subclass__(cls, **kwargs) -> None:
        """The constructor's signature, generated once from ``Options``, ``SETTINGS`` and the
        kernels' arguments: what ``inspect`` and ``repr`` show."""
        super().__init_subclass__(**kwargs)
        keyword = inspect.Parameter.KEYWORD_ONLY
        options = [
            inspect.Parameter(
                f.name,
                keyword,
                default=f.default,
                annotation=f.type,
            )
            for f in dataclasses.fields(cls.Options)
            if f.init
        ]
        settings = [
            inspect.Parameter(name, keyword, default=default)
            for name, default in cls.SETTINGS.items()
        ]
        kernels = [
            inspect.Parameter(name, keyword, default=default)
            for name, default in _KERNEL_ARGUMENTS.items()
        ]
        cls.__signature__ = inspect.Signature([*options, *settings, *kernels])

    def __new__(cls, **arguments: object) -> ContextParallelAttention:
        """An instance of the class whose op runs these options (``_running``)."""
        return super().__new__(cls._running(cls._split(arguments)[0]))

    @classmethod
    def _running(cls, options: StyleOptions) -> type[ContextParallelAttention]:
        """The class that runs ``options``: this one, except where a style's option selects
        another op (``UPipeAttention`` with ``chunk_tokens`` is ``UPipeFPDTAttention``)."""
        return cls

    @classmethod
    def _split(cls, arguments: dict[str, object]) -> tuple[StyleOptions, dict[str, object]]:
        """The constructor's keyword arguments as the style's ``Options`` and the rest."""
        names = {f.name for f in dataclasses.fields(cls.Options)}
        options = cls.Options(**{k: v for k, v in arguments.items() if k in names})
        return options, {k: v for k, v in arguments.items() if k not in names}

    def __init__(self, **arguments: object) -> None:
        """Keyword arguments: the style's options (``Options``: one spelling, None for unset),
        its ``SETTINGS`` and the kernels' (``backend``, ``kernel_device``, ``keep_attention``);
        ``inspect.signature(style class)`` lists them."""
        options, settings = self._split(arguments)
        self._configure(options, **settings)

    @classmethod
    def from_options(cls, options: StyleOptions, **settings: object) -> ContextParallelAttention:
        """The style with ``options`` (its ``Options``, e.g. from a job's ``[parallelism]``),
        as its constructor makes it from the same values; ``settings``: its ``SETTINGS`` and the
        kernels' (the registry's ``make_style`` builds every style this way)."""
        if type(options) is not cls.Options:
            raise TypeError(f"{cls.__name__} takes {cls.Options.__name__}, got {options!r}")
        style = object.__new__(cls._running(options))
        style._configure(options, **settings)
        return style

    def _configure(
        self,
        options: StyleOptions,
        *,
        backend: str = "auto",
        kernel_device: str | None = None,
        keep_attention: KeptAttention | None = None,
        **settings: object,
    ) -> None:
        """What every constructor sets: the options, checked as far as they can be before a
        model and a mesh exist, the style's ``SETTINGS`` (defaults for those not given) and the
        kernels' settings."""
        super().__init__()
        for name, default in self.SETTINGS.items():
            setattr(self, name, settings.pop(name, default))
        if settings:
            raise TypeError(
                f"{type(self).__name__} takes no argument {', '.join(sorted(settings))}; it "
                f"takes {', '.join(inspect.signature(type(self)).parameters)}"
            )
        options.check(Geometry(ring_degree=getattr(self, "ring_degree", None)))
        self.options = options
        self.kept = keep_attention
        """Where each layer's attention output and LSE wait for backward's recompute (None:
        recomputed; ``memory.kept_attention``)."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
        self.backend = backend
        self.kernel_device = kernel_device
        """The device type the kernels are chosen for (None: the tensors' own device). The trainer
        passes its device; the memory planner "cuda", tracing the CUDA kernels on fake tensors."""
        self._applied_axes: _Axes | None = None
        """Per-apply state, not a setting: this rank's axes on the mesh it is applied to (the
        constructor's arguments are never changed by ``parallelize_module``)."""

    def __repr__(self) -> str:
        """The class and its non-default arguments, as torch's styles print."""
        shown = [
            f"{p.name}={value!r}"
            for p in inspect.signature(type(self)).parameters.values()
            if (value := self._argument(p.name)) != p.default
        ]
        return f"{type(self).__name__}({', '.join(shown)})"

    def _argument(self, name: str) -> object:
        """The value of the constructor's argument ``name``: an option's, a setting's, or the
        kernels'."""
        if name == "keep_attention":
            return self.kept
        return getattr(self.options, name) if hasattr(self.options, name) else getattr(self, name)

    @property
    def applied_axes(self) -> _Axes | None:
        """This rank's axes, once the style is applied to a mesh."""
        return self._applied_axes

    def shard_positions(
        self, seq_len: int, cp_rank: int, cp_size: int, device: torch.device | None = None
    ) -> Tensor:
        """The global token indices rank ``cp_rank`` of the ``cp_size`` CP ranks feeds, in module
        order (on ``device``; None: in host memory)."""
        raise NotImplementedError

    def shard_rope(
        self,
        rope_at: Callable[[Tensor], Tensor],
        local_len: int,
        positions: Tensor | None = None,
        device: torch.device | None = None,
    ) -> Tensor:
        """The RoPE table of this rank's shard of ``local_len`` tokens by the model's rule
        ``rope_at`` (positions -> table, ``kernels.rope.rope_table``): at the layout's global
        positions (built on ``device``), or at the given (1, S/C) or (B, S/C) ``positions``. Our
        models compute it once per forward and pass it to every layer by name: no per-layer
        positions or float64 angles, and no host copy. Call after ``parallelize_module``, which
        tells the style its rank."""
        if self._applied_axes is None:
            raise ValueError(
                f"{type(self).__name__}.shard_rope: the style knows its rank once applied to its "
                "mesh; call it after parallelize_module"
            )
        return _shard_rope(self, self._applied_axes, rope_at, local_len, positions, device)

    def _positions(self, axes: _Axes, seq_len: int, device: torch.device) -> Tensor:
        """``shard_positions`` of this rank on ``axes`` (which know the mesh's ring degree)."""
        return self.shard_positions(seq_len, axes.cp_rank, axes.cp_degree, device)

    def _axes(self, mesh: DeviceMesh) -> _Axes:
        """A 1-D mesh is the head (all-to-all) axis."""
        _require_mesh_dims(self, mesh, (1,))
        return _Axes(_group_name(mesh, 0), mesh.size(), "", 1, mesh.get_local_rank())

    def _stage_params(
        self, n_heads: int, head_dim: int, axes: _Axes, seq_len: int
    ) -> AttentionParams:
        """The attention op's plain values of this style's stages on these axes, for attention
        of ``n_heads`` heads of ``head_dim`` over ``seq_len`` tokens."""
        return AttentionParams(
            head_group=axes.head_group,
            head_degree=axes.head_degree,
            ring_group=axes.ring_group,
            ring_degree=axes.ring_degree,
            head_dim=head_dim,
            heads_per_stage=self.options.stage_heads(n_heads, axes.head_degree),
            scale=head_dim**-0.5,
            backend=self.backend,
            kernel_device=self.kernel_device or "",
        )

    def _params(
        self, layer: AttentionLayer, weights: AttentionWeights, axes: _Axes, seq_len: int
    ) -> AttentionParams:
        """The fused attention op's plain values for a layer of ``layer``'s shape computing with
        ``weights`` (this tensor-parallel rank's heads) on these axes."""
        return dataclasses.replace(
            self._stage_params(
                weights.wq.shape[0] // layer.head_dim, layer.head_dim, axes, seq_len
            ),
            scale=layer.scale,
            rope_pairs=layer.rope_pairs,
            qk_transform=layer.qk_transform,
            qk_eps=layer.qk_eps,
            keep="" if self.kept is None or not torch.is_grad_enabled() else self.kept.name,
        )

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mesh: DeviceMesh,
        *,
        document_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """This style's attention over ``mesh`` on given queries, keys and values: the op-level
        entry, for other people's models, tests and benchmarks (no projections, no ``wo``).

        ``q`` (B, S/C, H, d), ``k`` and ``v`` (B, S/C, H_kv, d) are this rank's shard of the
        sequence in the style's layout (``shard_positions``: contiguous for UPipe and Ulysses),
        already rotated at their global positions; the attention is causal, or within each
        document when ``document_ids`` (B, S, the whole sequence's) are given; query head h uses
        KV head h // (H / H_kv). Returns (out (B, S/C, H, d), lse (B, H, S/C) float32) in the
        same layout, out differentiable in q, k and v (lse carries no gradient). The style's
        own arguments apply as in a model (``heads_per_stage``, ``overlap_stages``, ``backend``,
        the ring axis of a 2-D mesh); equal to torch's SDPA on the whole sequence up to
        rounding."""
        axes = self._axes(mesh)
        batch, local_len, n_heads, head_dim = q.shape
        if k.shape[:2] != q.shape[:2] or k.shape[3] != head_dim or v.shape != k.shape:
            raise ValueError(
                f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: give (B, S/C, H, d) "
                "queries and (B, S/C, H_kv, d) keys and values of one shard"
            )
        self.options.check(
            Geometry(
                n_heads=n_heads,
                n_kv_heads=k.shape[2],
                cp_degree=axes.cp_degree,
                ring_degree=mesh.size(0) if mesh.ndim == 2 else 1,  # 2D's ring axis
            )
        )
        seq_len = local_len * axes.cp_degree
        if document_ids is not None:
            _check_document_ids(document_ids, batch, seq_len)
        return self._attention_of(q, k, v, document_ids, axes, seq_len)

    def _attention_of(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        doc_ids: Tensor | None,
        axes: _Axes,
        seq_len: int,
    ) -> tuple[Tensor, Tensor]:
        """``attention`` once its arguments are checked: the staged op on given q, k, v."""
        params = self._stage_params(q.shape[2], q.shape[3], axes, seq_len)
        return qkv_attention(q, k, v, doc_ids, params)

    _op = staticmethod(staged_attention)
    """The fused op this style runs: (x, weights, rope, doc_ids, params) -> the layer's output
    (after ``wo``)."""

    def _forward(self, module: nn.Module, call: AttentionCall) -> Tensor:
        """The attention module's output for one call on this rank's shard (its adapter read
        the call): the fused op on this tensor-parallel rank's heads."""
        weights = module.cp_adapter.weights(module)
        mesh = tensor_parallel_mesh(weights)
        x = gathered_input(call.x, mesh)
        axes, layer = module.cp_axes, module.cp_layer
        local_len = x.shape[1]
        seq_len = local_len * axes.cp_degree
        if call.document_ids is not None:
            _check_document_ids(call.document_ids, x.shape[0], seq_len)
        if call.rope_table is not None:
            if call.rope_table.shape[-3] != local_len or call.positions is not None:
                raise ValueError(
                    f"a RoPE table passed for {call.rope_table.shape[-3]} tokens with positions "
                    f"{None if call.positions is None else tuple(call.positions.shape)} does not "
                    f"fit this rank's {local_len} tokens; pass the table of this shard alone "
                    "(shard_rope)"
                )
            rope = call.rope_table
        else:
            reach = call.rope_positions
            if call.positions is None and reach is not None and seq_len > reach:
                raise ValueError(
                    f"sequence length {seq_len} (= {local_len} local tokens x cp "
                    f"{axes.cp_degree}) exceeds the model's RoPE table of {reach} positions; "
                    f"build the model with max_seq_len >= {seq_len}"
                )
            rope = _shard_rope(self, axes, call.rope_at, local_len, call.positions, x.device)
        local = local_weights(weights, layer.head_dim, mesh)
        params = self._params(layer, local, axes, seq_len)
        return reduced_output(self._op(x, local, rope, call.document_ids, params), call.x, mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        adapter, layer, tp_degree = _check_attention_module(module)
        if self.kernel_device == "cuda" or self.backend in CUDA_BACKENDS:
            check_kernel_limits("sdpa" if self.backend == "auto" else self.backend, layer.head_dim)
        axes = self._axes(device_mesh)
        applied = self._applied_axes
        if applied not in (None, axes):
            raise ValueError(
                f"{self!r} is applied to a mesh already (rank {applied.cp_rank} of "
                f"{applied.cp_degree}, ring degree {applied.ring_degree}), and its "
                "shard_positions and shard_rope answer for that mesh; construct another style for "
                f"{device_mesh.mesh_dim_names} (rank {axes.cp_rank} of {axes.cp_degree})"
            )
        self.options.check(  # the geometry, checked before any forward
            Geometry(
                n_heads=layer.n_heads,
                n_kv_heads=layer.n_kv_heads,
                cp_degree=axes.cp_degree,
                ring_degree=device_mesh.size(0) if device_mesh.ndim == 2 else 1,  # 2D's ring axis
                tp_degree=tp_degree,
            )
        )
        module.cp_style, module.cp_axes = self, _AXES.setdefault(axes, axes)
        module.cp_adapter, module.cp_layer = adapter, layer
        module.__class__ = _context_parallel_class(type(module))
        self._applied_axes = axes
        return module


def _require_mesh_dims(style: ParallelStyle, mesh: DeviceMesh, allowed: tuple[int, ...]) -> None:
    if mesh.ndim not in allowed:
        shapes = " or ".join(f"{n}-D" for n in allowed)
        raise ValueError(
            f"{type(style).__name__} needs a {shapes} context-parallel mesh, got {mesh.ndim}-D "
            f"{mesh.mesh_dim_names}; pass the cp dimension(s), e.g. mesh['cp']"
            + (" or mesh['cp_ring', 'cp_heads']" if 2 in allowed else "")
        )


class _HeadAndRingAxes(ContextParallelAttention):
    """The Ulysses family's mesh: a head axis, and on a 2-D ``(cp_ring, cp_heads)`` mesh a ring
    axis across it (UPipe and Ulysses; 2D UPipe, the USP hybrid). The layout is contiguous on a
    1-D mesh, ``layouts.two_d_positions`` on a 2-D one."""

    SETTINGS = {"ring_degree": None}
    """``ring_degree`` (int, optional): R, the ring axis of the mesh the style will be applied
    to (1 for a 1-D mesh); None takes it from the mesh at ``parallelize_module``, until when
    ``shard_positions`` cannot know the layout and raises."""

    def shard_positions(
        self, seq_len: int, cp_rank: int, cp_size: int, device: torch.device | None = None
    ) -> Tensor:
        """Contiguous ``[r*S/C, (r+1)*S/C)`` on a 1-D mesh; on a 2-D mesh, rank
        ``ring_rank * (C/R) + head_rank`` holds its slice of the ring rank's zigzag tokens."""
        ring = self.ring_degree
        if ring is None and self._applied_axes is not None:
            ring = self._applied_axes.ring_degree
        if ring is None:
            raise ValueError(
                f"{type(self).__name__}.shard_positions: the layout depends on the ring degree, "
                "which is known once the style is applied to its mesh; call it after "
                "parallelize_module, or construct the style with ring_degree=R (1 for a 1-D mesh)"
            )
        return self._layout(seq_len, cp_rank, cp_size, ring, device)

    def _positions(self, axes: _Axes, seq_len: int, device: torch.device) -> Tensor:
        return self._layout(seq_len, axes.cp_rank, axes.cp_degree, axes.ring_degree, device)

    def _layout(
        self,
        seq_len: int,
        cp_rank: int,
        cp_size: int,
        ring_degree: int | None,
        device: torch.device | None,
    ) -> Tensor:
        if ring_degree == 1:
            return contiguous_positions(seq_len, cp_rank, cp_size, device)
        return two_d_positions(seq_len, cp_rank, cp_size, ring_degree, device)

    def _axes(self, mesh: DeviceMesh) -> _Axes:
        _require_mesh_dims(self, mesh, (1, 2))  # with chunks the ring degree is 1: the options'
        if mesh.ndim == 1:
            axes = super()._axes(mesh)
        elif mesh.mesh_dim_names != _TWO_D_NAMES:
            raise ValueError(
                f"a 2-D mesh for {type(self).__name__} must be {_TWO_D_NAMES} (ring across nodes, "
                f"heads inside a node), got {mesh.mesh_dim_names}; pass mesh['cp'] for 1-D CP or "
                f"mesh['cp_ring', 'cp_heads'] for 2D"
            )
        else:  # (ring, heads), heads innermost
            ring_rank, head_rank = mesh.get_local_rank(0), mesh.get_local_rank(1)
            axes = _Axes(
                _group_name(mesh, 1),
                mesh.size(1),
                _group_name(mesh, 0),
                mesh.size(0),
                ring_rank * mesh.size(1) + head_rank,
            )
        if self.ring_degree is not None and self.ring_degree != axes.ring_degree:
            raise ValueError(
                f"{type(self).__name__}(ring_degree={self.ring_degree}) applied to a mesh whose "
                f"ring axis has {axes.ring_degree} ranks ({mesh.mesh_dim_names}); construct it "
                f"with ring_degree={axes.ring_degree} or pass the matching mesh"
            )
        return axes


class _ChunkedSequence(ContextParallelAttention):
    """What running over sequence chunks makes of a style (FPDT, and UPipe x FPDT): FPDT's
    chunk-strided layout on a 1-D mesh, the host store earlier chunks are parked in, and FPDT's
    chunk loop (``parallel.fpdt_attention``) for the attention."""

    SETTINGS = {"host_device": torch.device("cpu")}
    """``host_device`` (torch.device): where earlier chunks are parked (pinned on CUDA); the
    memory planner passes a stand-in it counts as host memory."""

    def _configure(self, options: StyleOptions, **settings: object) -> None:
        super()._configure(options, **settings)
        self.host = HostMemory(self.host_device)

    @property
    def chunk_tokens(self) -> int:
        """Tokens per global sequence chunk (after the all-to-all)."""
        return self.options.chunk_tokens

    def shard_positions(
        self, seq_len: int, cp_rank: int, cp_size: int, device: torch.device | None = None
    ) -> Tensor:
        """Rank r's chunk i is global piece i*C + r (FPDT's Figure 6)."""
        chunks = chunk_count(seq_len, cp_size, self.options.chunk_tokens)
        return chunked_positions(seq_len, cp_rank, cp_size, chunks, device)

    def _positions(self, axes: _Axes, seq_len: int, device: torch.device) -> Tensor:
        return self.shard_positions(seq_len, axes.cp_rank, axes.cp_degree, device)

    def _stage_params(
        self, n_heads: int, head_dim: int, axes: _Axes, seq_len: int
    ) -> AttentionParams:
        params = super()._stage_params(n_heads, head_dim, axes, seq_len)
        chunks = chunk_count(seq_len, axes.cp_degree, self.options.chunk_tokens)
        return dataclasses.replace(params, chunks=chunks, store_name=self.host.name)

    _op = staticmethod(fpdt_attention)

    def _attention_of(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        doc_ids: Tensor | None,
        axes: _Axes,
        seq_len: int,
    ) -> tuple[Tensor, Tensor]:
        params = self._stage_params(q.shape[2], q.shape[3], axes, seq_len)
        return fpdt_qkv_attention(q, k, v, doc_ids, params)


class UPipeAttention(_HeadAndRingAxes):
    """Ulysses context parallelism run a few query heads at a time (UPipe, arXiv 2602.21196).

    On a 1-D CP mesh the module's input is this rank's contiguous sequence shard
    ``[r*S/C, (r+1)*S/C)``, shape (B, S/C, D), and so is its output: only the attention in between
    sees the whole sequence, for ``heads_per_stage / C`` heads at a time. On a 2-D
    ``(cp_ring, cp_heads)`` mesh (ring across nodes, heads inside a node, heads innermost) each
    stage's all-to-all runs over the head axis and its attention as ring attention over the ring
    axis (2D UPipe; with ``UlyssesAttention``, the USP hybrid); the layout is then
    ``layouts.two_d_positions`` (zigzag over the ring, contiguous inside the head group). With
    ``chunk_tokens`` each head stage also runs over sequence chunks, earlier chunks' K/V in host
    memory (UPipe x FPDT, 1-D mesh, FPDT's chunk-strided layout): the longest contexts.

    RoPE uses global positions: derived from ``shard_positions`` when ``positions`` is None, else
    the given (1, S/C) or (B, S/C) global indices. ``attention_masks`` is None (causal) or the
    (B, S) int document ids of the whole sequence (``data.documents.document_ids``): a token then
    sees only earlier tokens of its own document. Outputs and gradients equal the unsharded
    model's (same weights, same GQA pairing), up to rounding.

    Keyword Args:
        heads_per_stage (int, optional): U, the query heads exchanged per stage, across the head
            axis. A multiple of the head-axis degree that divides n_heads. ``None`` takes the
            default U of ``parallel.style_options.UPipeOptions``, which says what it is. Every
            option is also a ``[parallelism]`` key of the same name (``UPipeOptions``).
            U = n_heads is classic Ulysses.
        ring_degree (int, optional): R, the ring axis of the mesh this style will be applied to
            (1 for a 1-D mesh). ``None`` takes it from the mesh at ``parallelize_module``; until
            then ``shard_positions`` cannot know the layout and raises.
        chunk_tokens (int, optional): tokens per global sequence chunk (after the all-to-all);
            ``None`` runs each stage over the whole sequence (``[parallelism] chunk_tokens``, the
            same name and meaning).
        keep_attention (KeptAttention, optional): keep each layer's attention output and LSE
            from forward (on the device or the host) so that a checkpointed block's recompute
            skips the attention (``memory.kept_attention``); None recomputes it. Every style.
        overlap_stages (bool): start each stage's all-to-alls before the previous stage's
            attention and wait for them just before their use, so the exchanges run while
            attention computes (one more stage's Q/K/V or output buffers in flight; off by
            default: see ``UPipeOptions.overlap_stages``). No effect with one stage (Ulysses) or
            with ``chunk_tokens``, whose exchanges are waited for.
        backend (str): local attention kernel, one of ``kernels.backends.BACKENDS``: "fa3",
            "fa4" (FlashAttention-3/4 through torch's flash registry), "cudnn" (aten's cuDNN
            attention), "flash" (the flash-attn package), "sdpa" (aten's flash kernel,
            memory-efficient for float32, the CPU kernel on CPU), or "auto": on CUDA the first
            that runs here in ``kernels.backends.AUTO_ORDER`` (Hopper: fa3, cudnn, fa4, flash,
            sdpa), on CPU sdpa.
        kernel_device (str, optional): the device type the kernels are chosen for; None means
            the tensors' own. The memory planner passes "cuda" to trace the CUDA kernels on fake
            CPU tensors.
        host_device (torch.device): with ``chunk_tokens``, where earlier chunks are parked (pinned
            on CUDA); the memory planner passes a stand-in it counts as host memory.

    Example::
        >>> from torch.distributed.tensor.parallel import parallelize_module
        >>> parallelize_module(model, cp_mesh, {"layers.*.attention": UPipeAttention()})
        >>> logits_shard = model(tokens[:, rank * s_local : (rank + 1) * s_local])
    """

    Options = UPipeOptions
    SETTINGS = {**_HeadAndRingAxes.SETTINGS, **_ChunkedSequence.SETTINGS}

    @classmethod
    def _running(cls, options: StyleOptions) -> type[ContextParallelAttention]:
        if options.chunk_tokens is not None:
            return UPipeFPDTAttention
        return cls

    @property
    def chunk_tokens(self) -> None:
        """None: each stage runs over the whole sequence (``UPipeFPDTAttention`` chunks it)."""
        return None

    def _stage_params(
        self, n_heads: int, head_dim: int, axes: _Axes, seq_len: int
    ) -> AttentionParams:
        params = super()._stage_params(n_heads, head_dim, axes, seq_len)
        return dataclasses.replace(params, overlap_stages=self.options.overlaps_stages)


class UPipeFPDTAttention(_ChunkedSequence, UPipeAttention):
    """UPipe x FPDT: each head stage of ``UPipeAttention`` over sequence chunks, earlier chunks'
    K/V in host memory (1-D mesh, FPDT's chunk-strided layout ``layouts.chunked_positions``): the
    longest contexts. ``UPipeAttention(chunk_tokens=N)`` constructs this class, and so does the
    job key ``chunk_tokens`` with ``cp_style = "upipe"``; arguments and contract as for
    ``UPipeAttention`` (``overlap_stages`` has no effect: the chunks' exchanges are waited for).
    """

    SETTINGS = UPipeAttention.SETTINGS

    @classmethod
    def _running(cls, options: StyleOptions) -> type[ContextParallelAttention]:
        if options.chunk_tokens is None:
            raise TypeError(
                "UPipeFPDTAttention runs over sequence chunks: give chunk_tokens=N, or construct "
                "UPipeAttention for stages over the whole sequence"
            )
        return cls


class UlyssesAttention(_HeadAndRingAxes):
    """Classic DeepSpeed-Ulysses: every head in one stage (UPipe's stage loop with U =
    n_heads).

    Same contract and layout as ``UPipeAttention`` (on a 2-D mesh: the USP hybrid, Ulysses
    inside a node x ring across nodes); its own style so baselines and recipes name what they
    run. Keyword arguments: ``ring_degree`` and the kernels', as for ``UPipeAttention``.
    """

    Options = UlyssesOptions


class RingAttention(ContextParallelAttention):
    """Ring attention over the CP mesh, load-balanced for causal attention.

    Each rank holds two chunks of the sequence cut into 2C chunks, chunk r and chunk 2C-1-r
    (``layouts.ring_positions``; any S divisible by C), projects Q/K/V for all its tokens and heads,
    and passes K/V around the ring, merging the partial results exactly through their
    log-sum-exp (``parallel.ring``). Any number of KV heads works (no head-count limit). Same
    positions, document-mask and numerics contract as ``UPipeAttention``; the same staged op
    (one stage of every head, no head axis) as 2D UPipe.

    Keyword Args:
        backend, kernel_device: the local attention kernel, as for ``UPipeAttention``.
        keep_attention: attention kept for the recompute, as for ``UPipeAttention``.
    """

    Options = RingOptions

    def shard_positions(
        self, seq_len: int, cp_rank: int, cp_size: int, device: torch.device | None = None
    ) -> Tensor:
        """Rank r holds chunks r and 2C-1-r of 2C (the zigzag pairing)."""
        return two_d_positions(seq_len, cp_rank, cp_size, cp_size, device)

    def _axes(self, mesh: DeviceMesh) -> _Axes:
        """The 1-D mesh is the ring; there is no head axis."""
        _require_mesh_dims(self, mesh, (1,))
        return _Axes("", 1, _group_name(mesh, 0), mesh.size(), mesh.get_local_rank())


class FPDTAttention(_ChunkedSequence):
    """FPDT (arXiv 2408.16978): Ulysses attention over sequence chunks, earlier K/V on the host.

    Each rank's shard is ``ceil(S / chunk_tokens)`` chunks in FPDT's chunk-strided layout
    (``layouts.chunked_positions``): the all-to-all of chunk i gathers global chunk i of at most
    ``chunk_tokens`` tokens; its queries attend to it and to every earlier chunk, fetched back from
    host memory one at a time and merged through the log-sum-exp (``parallel.fpdt_attention``).
    Device memory for attention does not grow with the number of chunks. Every head runs in one
    stage, as published; UPipe x FPDT (fewer heads per stage) is
    ``UPipeAttention(heads_per_stage=U, chunk_tokens=...)``. Same positions, document-mask and
    numerics contract as ``UPipeAttention``.

    Keyword Args:
        chunk_tokens (int): tokens per global chunk (after the all-to-all); at least the CP degree
            (default: the FPDT paper's, ``style_options.FPDT_PAPER_CHUNK_TOKENS``).
        backend, kernel_device: the local attention kernel, as for ``UPipeAttention``.
        keep_attention: attention kept for the recompute, as for ``UPipeAttention``.
        host_device (torch.device): where earlier chunks are parked (pinned on CUDA); the memory
            planner passes a stand-in it counts as host memory.
    """

    Options = FPDTOptions


def _check_attention_module(module: nn.Module) -> tuple[AttentionAdapter, AttentionLayer, int]:
    """The module's adapter, its layer and the tensor-parallel degree of its heads; ValueError
    for a module the fused op would compute wrongly."""
    adapter = attention_adapter(module)  # refuses a class no adapter is registered for
    adapter.check(module)
    layer = adapter.layer(module)
    weights = adapter.weights(module)
    unused = unused_parameters(module, weights)
    if unused:
        raise ValueError(
            f"{type(module).__name__} has parameters {unused} that the context-parallel styles' "
            f"fused attention op does not compute with ({layer.family}: bias-free projections"
            + (f" and the {layer.qk_transform} of the q/k norms" if layer.qk_transform else "")
            + "); a model with them needs its family's op support"
        )
    mesh = tensor_parallel_mesh(weights)  # refuses DTensors of another layout
    if layer.head_dim % 2:
        raise ValueError(f"head_dim={layer.head_dim} must be even for rotary embeddings")
    return adapter, layer, 1 if mesh is None else mesh.size()


_AXES: dict[_Axes, _Axes] = {}
"""One ``_Axes`` per distinct value, shared by every layer on the same mesh."""
_CP_CLASSES: dict[type, type] = {}


def _context_parallel_class(cls: type) -> type:
    """``cls`` with the context-parallel forward: one class per attention class, which the style
    swaps in. A forward patched onto each layer would be guarded by ``torch.compile`` by its
    identity, so every block would compile again (and fullgraph compilation fails past dynamo's
    recompile limit); a class and a style shared by all layers are guarded once."""
    base = getattr(cls, "_cp_base", cls)
    if base not in _CP_CLASSES:
        _CP_CLASSES[base] = type(
            f"ContextParallel{base.__name__}",
            (base,),
            {"forward": _cp_forward, "_cp_base": base, "__module__": __name__},
        )
    return _CP_CLASSES[base]


def _cp_forward(self: nn.Module, *args: object, **kwargs: object) -> Tensor:
    """The attention module's forward under its style: the arguments of the module's own forward,
    read by its adapter (``parallel.attention_interface``)."""
    return self.cp_style._forward(self, self.cp_adapter.call(self, *args, **kwargs))


def _shard_rope(
    style: ContextParallelAttention,
    axes: _Axes,
    rope_at: Callable[[Tensor], Tensor],
    local_len: int,
    positions: Tensor | None,
    device: torch.device | None,
) -> Tensor:
    """The RoPE table of this rank's ``local_len`` tokens by ``rope_at``: at the given global
    ``positions``, checked, or at the layout's."""
    if positions is None:
        positions = style._positions(axes, local_len * axes.cp_degree, device)
    elif positions.shape[-1] != local_len or positions.dim() != 2:
        raise ValueError(
            f"positions must be (1, {local_len}) or (B, {local_len}) global indices of this "
            f"rank's shard, got shape {tuple(positions.shape)}"
        )
    elif positions.shape[0] == 1:
        positions = positions[0]
    return rope_at(positions)


def _check_document_ids(doc_ids: object, batch: int, seq_len: int) -> None:
    if (
        not isinstance(doc_ids, Tensor)
        or doc_ids.shape != (batch, seq_len)
        or doc_ids.is_floating_point()
    ):
        shape = tuple(doc_ids.shape) if isinstance(doc_ids, Tensor) else type(doc_ids).__name__
        raise ValueError(
            f"attention_masks must be None (causal) or the ({batch}, {seq_len}) integer document "
            f"ids of the whole sequence (upipe_dtensor.data.documents.document_ids), got {shape}"
        )
