"""What the torchtitan plug-in does on every torchtitan generation: the ``[upipe]`` section, the
style it makes, where the style's layout meets torchtitan's load balancer, and torchtitan's
parallel dims with its own CP switched off. The generations' plug-ins (``tt022``, ``tt030``)
build torchtitan's trainer around these."""

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch
import tyro
from torch import Tensor, nn

from upipe_dtensor.kernels.backends import BACKENDS
from upipe_dtensor.parallel import ContextParallelAttention
from upipe_dtensor.parallel.registry import STYLES, make_style, option_types, style_name
from upipe_dtensor.parallel.style_options import Geometry, OptionError
from upipe_dtensor.runtime.torch_private import head_tail_indices


@dataclass
class UPipeSettings:
    """The ``[upipe]`` keys that are not a style's own options (those are added below from the
    registry, so every registered style's options are keys here too)."""

    cp_style: str = "upipe"
    """Context-parallel attention over torchtitan's cp mesh: 'upipe' (a few heads per stage),
    'ulysses' (all heads), 'ring' (K/V around the CP group) or 'fpdt' (Ulysses over sequence
    chunks, earlier chunks' K/V in host memory). As this project's [parallelism] cp_style.
    Checked by the plug-in, not the parser, so a wrong name is one line, not one per rank."""
    attention_backend: str = "auto"
    """Local attention kernel, as this project's [parallelism] attention_backend: 'auto' (the
    fastest that runs here; sdpa on CPU), 'fa3', 'fa4', 'cudnn', 'flash' or 'sdpa'. Checked by
    the plug-in, as cp_style is."""
    ring_degree: int = 1
    """Must be 1: 2D context parallelism (> 1) needs a (cp_ring, cp_heads) mesh, which torchtitan
    does not build (this project's trainer does)."""
    tiled_mlp: bool = False
    """Run each SwiGLU MLP over tiles of tokens (this project's [memory] tiled_mlp)."""
    mlp_tile_tokens: int = 0
    """Tokens per MLP tile; 0: the model width."""
    tiled_rms_norm: bool = False
    """Run every RMSNorm over tiles of tokens (this project's [memory] tiled_rms_norm)."""
    norm_tile_tokens: int = 0
    """Tokens per RMSNorm tile; 0: the model width."""


def _option_field(key: str, kind: Any) -> tuple[str, Any, Any]:
    """A style option as an ``[upipe]`` key: its type or None (unset: the style's default)."""
    takers = " and ".join(repr(name) for name, spec in STYLES.items() if spec.takes(key))
    text = (
        f"Option of cp_style {takers}, as this project's [parallelism] {key} (docs/training.md); "
        "unset: the style's default."
    )
    return key, Annotated[kind | None, tyro.conf.arg(help=text)], field(default=None)


UPipe = dataclasses.make_dataclass(
    "UPipe",
    [_option_field(key, kind) for key, kind in option_types().items()],
    bases=(UPipeSettings,),
)
UPipe.__doc__ = """[upipe]: the CP style torchtitan's trainer runs, with this project's
[parallelism] names, checked as its job files are (parallel.registry.make_style)."""


class WithoutTorchtitanCP:
    """``parallel_dims`` as torchtitan's parallelize functions should see it once the style is
    applied: its meshes, FSDP over ``dp_shard x cp`` and every other setting unchanged, but
    ``cp_enabled`` False, the one flag by which they apply torchtitan's own CP (``llama3`` and
    ``qwen3``'s ``parallelize_*`` in torchtitan 0.2.2 and 0.3.0 read it only for that and for
    TP, which is refused here)."""

    cp_enabled = False

    def __init__(self, parallel_dims: Any) -> None:
        self._parallel_dims = parallel_dims

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parallel_dims, name)


def torchtitan_layout(balancer: str | None, seq_len: int, cp_degree: int) -> list[Tensor] | None:
    """The global token indices torchtitan's trainer feeds each cp rank with ``balancer``, as its
    ``distributed.context_parallel.cp_shard`` cuts them: torch's head-tail balancer reorders the
    sequence ('headtail'), then it is cut into C equal pieces. None for 'ptrr', which reorders by
    the batch's flex block masks (which the styles do not take)."""
    order = torch.arange(seq_len)
    if balancer == "headtail":
        order = order[head_tail_indices(seq_len, cp_degree)]
    elif balancer is not None:
        return None
    return list(order.chunk(cp_degree))


def _spans(index: Tensor) -> str:
    """``index`` as its runs of consecutive tokens, e.g. '0-7, 56-63'."""
    values = index.tolist()
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            first, last = values[start], values[i - 1]
            runs.append(f"{first}" if first == last else f"{first}-{last}")
            start = i
    return ", ".join(runs)


def fitting_balancers(
    style: ContextParallelAttention, seq_len: int, cp_degree: int
) -> list[str | None]:
    """The torchtitan balancers (None, 'headtail') that feed every cp rank the tokens ``style``
    expects, in its order."""
    return [name for name in (None, "headtail") if balancer_fits(style, name, seq_len, cp_degree)]


def balancer_fits(
    style: ContextParallelAttention, balancer: str | None, seq_len: int, cp_degree: int
) -> bool:
    """Whether torchtitan's trainer, cutting sequences by ``balancer``, feeds every cp rank the
    tokens ``style`` expects, in its order."""
    layout = torchtitan_layout(balancer, seq_len, cp_degree)
    return layout is not None and all(
        torch.equal(layout[rank], style.shard_positions(seq_len, rank, cp_degree))
        for rank in range(cp_degree)
    )


def check_load_balancer(
    style: ContextParallelAttention,
    balancer: str | None,
    seq_len: int,
    cp_degree: int,
    *,
    no_balancer_fix: str = (
        "no torchtitan balancer lays it out: launch with -m upipe_dtensor.integrations."
        "torchtitan (same arguments), whose trainer lays out inputs by the style"
    ),
) -> None:
    """ValueError (one line, naming the fix) unless torchtitan's trainer, cutting sequences by
    ``balancer``, feeds every cp rank the tokens ``style`` expects, in its order;
    ``no_balancer_fix`` is the fix when no torchtitan balancer does."""
    if balancer_fits(style, balancer, seq_len, cp_degree):
        return
    fitting = fitting_balancers(style, seq_len, cp_degree)
    if fitting == [None]:
        fix = (
            "remove context_parallel_load_balancer from the job file (None is this plug-in's "
            "default) or pass --parallelism.context_parallel_load_balancer None"
        )
    elif fitting:
        fix = f"set [parallelism] context_parallel_load_balancer = {fitting[0]!r}"
    else:
        fix = no_balancer_fix
    given = torchtitan_layout(balancer, seq_len, cp_degree)
    fed = f"gives rank 0 tokens {_spans(given[0])}" if given else "reorders by flex block masks"
    expected = _spans(style.shard_positions(seq_len, 0, cp_degree))
    raise ValueError(
        f"[parallelism] context_parallel_load_balancer = {balancer!r} {fed}, but [upipe] "
        f"cp_style = {style_name(style)!r} expects rank 0 to hold tokens {expected} of "
        f"{seq_len} (RoPE would stay right, the causal order would be wrong): {fix}"
    )


def make_cp_style(
    args: Any, settings: Any, cp_degree: int, seq_len: int, tp_degree: int = 1
) -> ContextParallelAttention:
    """The ``[upipe]`` section's style for a model whose ``args`` (torchtitan 0.2.2's model args,
    or an attention module: anything with ``n_heads`` and ``n_kv_heads``) run on ``cp_degree``
    ranks, each with 1 / ``tp_degree`` of the heads, checked as this project checks
    ``[parallelism]`` (ValueError naming the keys and a fix)."""
    if settings.ring_degree != 1:
        raise ValueError(
            f"[upipe] ring_degree = {settings.ring_degree}: 2D context parallelism needs a "
            "(cp_ring, cp_heads) mesh, which torchtitan's ParallelDims does not build; set "
            "ring_degree = 1, or train with this project's train.py (recipes/multinode/)"
        )
    if settings.attention_backend not in BACKENDS:
        raise ValueError(
            f"[upipe] attention_backend = {settings.attention_backend!r} is not one of "
            f"{list(BACKENDS)}"
        )
    try:
        return make_style(
            settings,
            Geometry(
                n_heads=args.n_heads,
                n_kv_heads=getattr(args, "n_kv_heads", None) or args.n_heads,
                cp_degree=cp_degree,
                ring_degree=1,
                seq_len=seq_len,
                tp_degree=tp_degree,
            ),
            backend=settings.attention_backend,
        )
    except OptionError as err:
        raise ValueError(f"[upipe] {err}") from None


def refuse_tensor_parallelism(degree: int) -> None:
    """ValueError for ``degree`` > 1 in torchtitan 0.2.2's trainer, whose tensor-parallel plan
    wraps the attention's projections for its own forward (0.3.0's plug-in and this project's
    ``train.py`` take it)."""
    if degree > 1:
        raise ValueError(
            f"[parallelism] tensor_parallel_degree = {degree}: the torchtitan 0.2.2 plug-in runs "
            "the CP styles without tensor parallelism; set tensor_parallel_degree = 1, or train "
            "with torchtitan 0.3.0's plug-in or this project's train.py "
            "([parallelism] tensor_parallel_degree)"
        )


def applied_style(model: nn.Module) -> ContextParallelAttention | None:
    """The CP style applied to ``model``'s attention modules (found through torchtitan's
    checkpoint, compile and FSDP wrappers), None without one."""
    for module in model.modules():
        style = getattr(module, "cp_style", None)
        if isinstance(style, ContextParallelAttention):
            return style
    return None
