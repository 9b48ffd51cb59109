"""The longest context a model trains at on given GPUs, and the settings that get there.

``python -m upipe_dtensor.plan --config R.toml --max-context`` asks: with this model and memory
stack, ``--world-size`` GPUs of ``--device-memory-gib`` each and ``--host-memory-gib`` of RAM per
node, what is the longest sequence whose planned step fits both budgets, and which settings
should the recipe use there? The answer is a recipe (TOML extending ``R.toml``) and its plan.

Every rank splits the sequence (context_parallel_degree = world size): data parallelism does not
lengthen the context. A world larger than one node runs UPipe/Ulysses in 2D, as the paper does: a
ring of world / gpus_per_node nodes times an all-to-all head axis inside each node.

The search has two phases:

1. **Longest context.** Every searched setting at its most memory-saving value (``Knob.values[0]``)
   and the secant search of ``length_search`` over seq_len. Nothing else can go longer (each
   setting's saving end uses the least device memory), except for the two settings that trade
   device memory against host RAM: FSDP CPU offload (on: less device, more host) and blocks
   checkpointed in pairs (less host, more device). Phase 1 starts with both on; a host-bound
   limit is searched again with FSDP offload off, a device-bound one with pairs off, and the
   longer answer wins (one plan, when the other setting does not fit at the length already
   found: it cannot go longer). Sequence chunks start from the fewest that plan as
   low as the most at the recipe's length: once the peak lies outside attention (Llama3-8B at
   5M: 4 chunks and more plan the same), more chunks save nothing and each costs training time
   and planning time (a plan with 8 chunks takes ~3.6x one with 2).
2. **Relaxation.** At that length, settings move one at a time from their saving end toward the
   faster end, one step per plan, as long as the plan still fits. The order spends the margin
   where it buys the most speed first:

   - ``keep_attention``: kept attention outputs spare the recompute's attention forward, about
     a quarter of a long-context step, for the outputs' memory (host first, then device,
     each tried whether or not the other fits);
   - ``kept_layers``: with each place, as many blocks keep theirs as fit there, from the last
     eighth of the model up, an eighth at a time (``keep_attention_skip_first``); then the
     places are compared (at 5M four blocks fit on the device, sixteen on the host);
   - ``sequence_chunks`` (UPipe x FPDT): with n chunks every query chunk fetches all earlier
     chunks' K/V from host memory (n(n-1)/2 host-to-device copies per stage instead of none) and
     attention runs as n(n+1)/2 smaller kernels: the costliest saving;
   - ``blocks_per_checkpoint``: pairs recompute one more block forward per pair in backward
     (about an eighth of the step);
   - ``heads_per_stage``: U = C is the least memory; a larger U runs fewer, larger stages (fewer
     all-to-alls and kernel launches per layer);
   - ``fsdp_cpu_offload``: the optimizer steps on the host and parameters are copied in every
     step; at millions of tokens a step takes minutes, so this costs little, but something;
   - ``tile_sizes``: MLP, RMSNorm and loss tiles of a quarter or half the recipe's size cut
     their temporaries; at >= 1024 tokens per tile the extra launches are cheap;
   - ``block_input_prefetch``: without it one (S/C x D) copy per block is not hidden behind the
     previous block's recompute, a fraction of a second per block that takes minutes;
   - ``overlap_stages``: the next head stage's exchanges in flight (several stage buffers) hide
     all-to-alls that are a small share of the step on NVLink (sequence chunks wait anyway).

Since relaxing only ever adds memory, the length of phase 1 stays the longest that fits. A
relaxed setting is kept only if the step-time model (``planning.step_time``, the plan's ``speed``)
predicts it no slower, by its central value (not the band): the order above is the expected one,
the model decides.

**Tensor parallelism** (``--search tensor_parallel``, only when named: it multiplies the search)
is a choice around both phases rather than a setting inside them: it changes how the world splits
(cp = world / tp, the heads each rank holds), so the whole search runs once per degree that fits
the model and a node (tp divides the GPUs per node, the query and KV heads), and the longest
context wins (``--objective speed``: the fastest). The recipe says what each degree reached.

``--objective speed`` skips phase 1: at the recipe's own seq_len it starts from every setting at
its saving end (which must fit) and relaxes the same way, giving the fastest settings that fit.

A plan whose traced step was traced already is rebuilt from that trace (``step.TraceCache``), and
the plans share dynamo's compiled graphs (``compiled.shared_compiles``): each compiles only what
the plans before it did not.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from upipe_dtensor.config import ConfigError, JobConfig, check_job
from upipe_dtensor.errors import DoesNotFit
from upipe_dtensor.models.hf_config import model_args
from upipe_dtensor.parallel.head_schedule import valid_heads_per_stage
from upipe_dtensor.parallel.style_options import searched_options
from upipe_dtensor.planning.compiled import shared_compiles
from upipe_dtensor.planning.floor import refuse_impossible
from upipe_dtensor.planning.length_search import GRANULE_TOKENS_PER_RANK, longest_fitting
from upipe_dtensor.planning.step import Budget, GiB, Plan, TraceCache, plan_job

MAX_SEQUENCE_CHUNKS = 8
"""The most UPipe x FPDT chunks searched. Chunks shrink only the per-chunk q/k/v/o buffers of one
head stage; at 8 chunks those are below the layer's whole output buffer (S/C x H x d) that no
chunking removes, and each chunk more makes planning and training slower (n(n+1)/2 kernel pairs)."""
TILE_DIVISORS = (4, 2, 1)
"""Tile sizes searched: the recipe's MLP, RMSNorm and loss tiles divided by these, together."""


@dataclass(frozen=True)
class Knob:
    """One setting the search may choose: its values from the most memory-saving to the fastest,
    and how a value is written into a config."""

    name: str
    values: tuple
    keys: tuple[str, ...]
    """The ``section.key`` entries this setting writes (what the printed recipe sets)."""
    apply: Callable[[JobConfig, Any], JobConfig]
    show: Callable[[Any], str]


def _replace(config: JobConfig, section: str, **changes: Any) -> JobConfig:
    return config.with_values({f"{section}.{key}": value for key, value in changes.items()})


def _setting(name: str, values: tuple, key: str, show: Callable[[Any], str]) -> Knob:
    """A knob that writes one ``section.key`` of the config."""
    section, field_name = key.split(".")
    return Knob(
        name, values, (key,), lambda c, value: _replace(c, section, **{field_name: value}), show
    )


def _chunks(config: JobConfig, count: int) -> JobConfig:
    seq_len = config.training.seq_len
    return _replace(config, "parallelism", chunk_tokens=-(-seq_len // count) if count > 1 else None)


def _kept_layers(config: JobConfig, skip_first: int) -> JobConfig:
    """Which blocks keep their attention; none to choose while attention is recomputed (the
    ``keep_attention`` knob is applied first)."""
    kept = config.activation_checkpoint.keep_attention != "none"
    return _replace(config, "activation_checkpoint", keep_attention_skip_first=skip_first * kept)


def _tiles(config: JobConfig, divisor: int, width: int, recipe: JobConfig) -> JobConfig:
    memory = recipe.memory
    return _replace(
        config,
        "memory",
        mlp_tile_tokens=max(1, (memory.mlp_tile_tokens or width) // divisor),
        norm_tile_tokens=max(1, (memory.norm_tile_tokens or width) // divisor),
        loss_chunk_tokens=max(1, memory.loss_chunk_tokens // divisor),
    )


KNOB_NAMES = (
    "keep_attention",
    "kept_layers",
    "sequence_chunks",
    "blocks_per_checkpoint",
    "heads_per_stage",
    "fsdp_cpu_offload",
    "tile_sizes",
    "block_input_prefetch",
    "overlap_stages",
)
"""Every setting the search knows, in relaxation order (see the module docstring)."""
TENSOR_PARALLEL = "tensor_parallel"
"""``--search`` name of the tensor-parallel degree, searched around the rest (module docstring)."""
SEARCH_NAMES = (TENSOR_PARALLEL, *KNOB_NAMES)
"""What ``--search`` may name: tensor parallelism (around the rest) and every setting."""


def knobs(config: JobConfig) -> dict[str, Knob | str]:
    """The searchable settings of ``config`` (already laid out on its world), in relaxation order;
    a setting that does not apply maps to the reason why."""
    parallelism, memory = config.parallelism, config.memory
    args = model_args(config.model, config.training.seq_len)
    heads_axis = parallelism.head_degree
    searched = searched_options(parallelism.style.options)  # as the style declares them
    found: dict[str, Knob | str] = {}
    not_upipe = f"UPipe's setting; cp_style is {parallelism.cp_style!r}"
    found["keep_attention"] = (
        _setting(
            "keep_attention",
            ("none", "host", "device"),
            "activation_checkpoint.keep_attention",
            lambda where: (
                "attention recomputed" if where == "none" else f"attention kept ({where})"
            ),
        )
        if config.activation_checkpoint.mode == "full"
        else "nothing is recomputed: [activation_checkpoint] mode is not 'full'"
    )
    found["kept_layers"] = (
        Knob(
            "kept_layers",
            kept_layer_skips(args.n_layers),
            ("activation_checkpoint.keep_attention_skip_first",),
            _kept_layers,
            lambda skip: f"{args.n_layers - skip} of {args.n_layers} blocks keep",
        )
        if config.activation_checkpoint.mode == "full"
        else found["keep_attention"]
    )
    found["overlap_stages"] = (
        _setting(
            "overlap_stages",
            (False, True),
            "parallelism.overlap_stages",
            lambda on: "stages overlapped" if on else "stages in turn",
        )
        if "overlap_stages" in searched
        else not_upipe
    )
    if "heads_per_stage" not in searched:
        found["heads_per_stage"] = not_upipe
    if "chunk_tokens" not in searched:
        found["sequence_chunks"] = not_upipe
    elif parallelism.ring_degree > 1:
        found["sequence_chunks"] = "sequence chunks do not combine with a ring across nodes"
    if "sequence_chunks" not in found:
        counts = tuple(2**k for k in range(int(math.log2(MAX_SEQUENCE_CHUNKS)), -1, -1))
        found["sequence_chunks"] = Knob(
            "sequence_chunks",
            counts,
            ("parallelism.chunk_tokens",),
            _chunks,
            lambda n: f"{n} chunks" if n > 1 else "no chunks",
        )
    offloaded = (
        config.activation_checkpoint.mode == "full" and config.activation_checkpoint.cpu_offload
    )
    found["blocks_per_checkpoint"] = (
        _setting(
            "blocks_per_checkpoint",
            (2, 1),
            "activation_checkpoint.blocks_per_checkpoint",
            lambda k: "checkpoint pairs" if k == 2 else "checkpoint each block",
        )
        if offloaded
        else "block inputs are not offloaded: [activation_checkpoint] mode = 'full' and "
        "cpu_offload = true"
    )
    if "heads_per_stage" not in found:
        tp = parallelism.tensor_parallel_degree  # U counts the heads of one tensor-parallel rank
        valid = valid_heads_per_stage(
            args.n_heads // tp, (args.n_kv_heads or args.n_heads) // tp, heads_axis
        )
        found["heads_per_stage"] = _setting(
            "heads_per_stage", tuple(valid), "parallelism.heads_per_stage", lambda u: f"U={u}"
        )
    found["fsdp_cpu_offload"] = _setting(
        "fsdp_cpu_offload",
        (True, False),
        "training.enable_cpu_offload",
        lambda on: "FSDP offload" if on else "no FSDP offload",
    )
    tiled = [
        key
        for key, on in (
            ("memory.mlp_tile_tokens", memory.tiled_mlp),
            ("memory.norm_tile_tokens", memory.tiled_rms_norm),
            ("memory.loss_chunk_tokens", memory.chunked_loss),
        )
        if on
    ]
    found["tile_sizes"] = (
        Knob(
            "tile_sizes",
            TILE_DIVISORS,
            tuple(tiled),
            lambda c, d: _tiles(c, d, args.dim, config),
            lambda d: f"tiles/{d}" if d > 1 else "recipe tiles",
        )
        if tiled
        else "the recipe tiles nothing: [memory] tiled_mlp, tiled_rms_norm, chunked_loss are off"
    )
    found["block_input_prefetch"] = (
        _setting(
            "block_input_prefetch",
            (False, True),
            "activation_checkpoint.cpu_offload_prefetch",
            lambda on: "prefetch" if on else "no prefetch",
        )
        if config.activation_checkpoint.cpu_offload
        else "block inputs stay on the device: [activation_checkpoint] cpu_offload is off"
    )
    return {name: found[name] for name in KNOB_NAMES}


def kept_layer_skips(n_layers: int) -> tuple[int, ...]:
    """``keep_attention_skip_first`` values searched: the last eighth of the blocks keeping their
    attention, then a quarter, ..., then all; the most memory-saving first."""
    keeping = sorted({max(1, round(n_layers * eighth / 8)) for eighth in range(1, 9)})
    return tuple(n_layers - count for count in keeping)


def _inert(name: str, settings: dict[str, Any], recipe_keep: str) -> bool:
    """Whether a setting changes nothing under the others: which blocks keep their attention,
    while attention is recomputed in all of them (``recipe_keep``: the recipe's
    ``keep_attention``, where the search does not set it)."""
    return name == "kept_layers" and settings.get("keep_attention", recipe_keep) == "none"


def _valid_worlds(config: JobConfig, gpus_per_node: int, upto: int) -> list[int]:
    worlds = []
    for world in range(1, upto + 1):
        try:
            on_world(config, world, gpus_per_node)
        except ConfigError:
            continue
        worlds.append(world)
    return worlds


def on_world(config: JobConfig, world: int, gpus_per_node: int) -> JobConfig:
    """``config`` with every rank splitting the sequence (its tensor-parallel degree kept: the
    other ranks split it over cp), 2D across nodes for UPipe/Ulysses; ConfigError when the
    model's heads do not split over that many ranks."""
    options = config.parallelism.style.options
    tp = config.parallelism.tensor_parallel_degree
    if world % tp:
        raise ConfigError(f"--world-size {world} is not a multiple of tensor_parallel_degree {tp}")
    cp, cp_per_node = world // tp, max(1, gpus_per_node // tp)
    ring = cp // cp_per_node if cp > cp_per_node and options.ring_axis else 1
    if ring > 1 and cp % cp_per_node:
        raise ConfigError(
            f"--world-size {world} is not whole nodes of --gpus-per-node {gpus_per_node}"
        )
    heads_axis = cp // ring
    if options.head_axis:
        args = model_args(config.model, config.training.seq_len)
        n_heads, n_kv = args.n_heads, args.n_kv_heads or args.n_heads
        if (
            n_heads % tp
            or n_kv % tp
            or not valid_heads_per_stage(n_heads // tp, n_kv // tp, heads_axis)
        ):
            on_tp = f" (1/{tp} of them on each tensor-parallel rank)" if tp > 1 else ""
            raise ConfigError(
                f"the {n_heads} query / {n_kv} KV heads of flavor {config.model.flavor!r}"
                f"{on_tp} do not split over {heads_axis} ranks"
            )
    on_ring = {"chunk_tokens": None} if ring > 1 else {}  # chunks stay on one node
    return _replace(
        config,
        "parallelism",
        context_parallel_degree=cp,
        data_parallel_shard_degree=-1,
        ring_degree=ring,
        **on_ring,
    )


@dataclass
class MaxContext:
    """What the search found: the recipe's config at the longest context, and how it got there."""

    config: JobConfig
    plan: Plan
    settings: dict[str, Any]
    searched: list[Knob]
    not_searched: dict[str, str]
    plans: list[tuple[dict[str, Any], Plan]] = field(default_factory=list)
    seconds: float = 0.0
    limited_by: str = ""
    """What stops a longer context: "device memory", "host memory" or both (``Plan.exceeds`` of
    the shortest plan found not to fit)."""
    objective: str = "length"
    """"length": the longest context; "speed": the fastest settings at the recipe's length."""
    traces: int = 0
    """Steps traced: plans whose traced job was traced already are rebuilt from that trace
    (``step.TraceCache``)."""
    by_tensor_parallel: dict[int, MaxContext | str] = field(default_factory=dict)
    """With tensor parallelism searched: each degree's own result, or why it could not run."""

    @property
    def seq_len(self) -> int:
        return self.plan.seq_len

    def as_dict(self, command: str) -> dict:
        return {
            "seq_len": self.seq_len,
            "settings": self.settings,
            "not_searched": self.not_searched,
            "recipe_toml": recipe_toml(self, command),
            "plan": self.plan.as_dict(),
            "limited_by": self.limited_by,
            "plans": [
                {"settings": s, **_summary(p), "fits": p.fits, "exceeds": p.exceeds}
                for s, p in self.plans
            ],
            "seconds": round(self.seconds, 1),
            "traces": self.traces,
            "objective": self.objective,
            "by_tensor_parallel": {
                tp: found if isinstance(found, str) else _summary(found.plan)
                for tp, found in self.by_tensor_parallel.items()
            },
        }


def describe(settings: dict[str, Any], searched: list[Knob], recipe_keep: str) -> str:
    return ", ".join(
        knob.show(settings[knob.name])
        for knob in searched
        if not _inert(knob.name, settings, recipe_keep)
    )


def _summary(plan: Plan) -> dict[str, Any]:
    """A plan's length, memory and predicted speed, as the search's JSON lists them."""
    return {
        "seq_len": plan.seq_len,
        "device_peak_bytes": plan.device_peak_bytes,
        "host_per_node_bytes": plan.host_per_node_bytes,
        "tokens_per_s_per_gpu": plan.speed.tokens_per_s_per_gpu if plan.speed else None,
        "tokens_per_s_per_gpu_range": (
            list(plan.speed.tokens_per_s_per_gpu_range) if plan.speed else None
        ),
    }


def _with_tensor_parallel(config: JobConfig, tp: int, world: int, gpus_per_node: int) -> JobConfig:
    """``config`` at tensor-parallel degree ``tp``, laid out on ``world`` GPUs (cp = world / tp);
    a ``heads_per_stage`` that is not one of the values ``knobs`` finds there (it does not split
    one tp rank's heads over the head axis) is unset (U = C, the least memory)."""
    at = on_world(
        config.with_values({"parallelism.tensor_parallel_degree": tp}), world, gpus_per_node
    )
    stage, valid = at.value("parallelism.heads_per_stage"), knobs(at)["heads_per_stage"]
    if stage is None or not isinstance(valid, Knob) or stage in valid.values:
        return at
    return at.with_values({"parallelism.heads_per_stage": None})


def _tensor_parallel_knob(degrees: tuple[int, ...]) -> Knob:
    """The degree as the printed recipe sets it (with the heads per stage it may have unset)."""
    return Knob(
        TENSOR_PARALLEL,
        degrees,
        ("parallelism.tensor_parallel_degree", "parallelism.heads_per_stage"),
        lambda config, tp: config.with_values({"parallelism.tensor_parallel_degree": tp}),
        lambda tp: f"tp {tp}",
    )


@shared_compiles()  # each plan reuses the graphs the plans before it compiled
def find_max_context(
    config: JobConfig,
    budget: Budget,
    world_size: int | None = None,
    *,
    search: list[str] | None = None,
    resolution: float = 0.0,
    log: Callable[[str], None] = lambda _: None,
    objective: str = "length",
    full_trace: bool = False,
) -> MaxContext:
    """Run both phases (module docstring) for ``config`` on ``world_size`` GPUs (default: the
    recipe's world, cp x dp_shard). ``search`` names the settings to search (default: all that
    apply, tensor parallelism aside); the rest stay as the recipe has them.
    ``objective="speed"``: only phase 2, at the recipe's seq_len. ``full_trace``: every plan
    traces every block (``plan_job``)."""
    search_one = functools.partial(
        _find_at_one_degree,
        budget=budget,
        resolution=resolution,
        log=log,
        objective=objective,
        full_trace=full_trace,
    )
    if search is None or TENSOR_PARALLEL not in search:
        return search_one(config, world_size, search)
    started = time.perf_counter()
    world_size = world_size or config.parallelism.world_size
    seq_len = config.training.seq_len * world_size // config.parallelism.world_size
    config = config.with_values({"training.seq_len": seq_len})  # as on the recipe's own layout
    inner = [name for name in search if name != TENSOR_PARALLEL]
    per_node = budget.gpus_per_node  # a tensor-parallel group stays inside a node
    degrees = tuple(tp for tp in range(1, per_node + 1) if per_node % tp == 0)
    results: dict[int, MaxContext | str] = {}
    for tp in degrees:
        log(f"tensor_parallel_degree {tp}:")
        try:
            at = _with_tensor_parallel(config, tp, world_size, budget.gpus_per_node)
            check_job(at, world_size)
            results[tp] = search_one(at, world_size, inner)
        except (ConfigError, DoesNotFit) as err:
            results[tp] = str(err).splitlines()[0]
            log(f"  tp {tp}: {results[tp]}")
    found = {tp: r for tp, r in results.items() if isinstance(r, MaxContext)}
    if not found:
        raise DoesNotFit(
            "no tensor-parallel degree fits: "
            + "; ".join(f"tp {tp}: {why}" for tp, why in results.items())
        )

    def rank(result: MaxContext) -> tuple[float, float]:
        speed = result.plan.speed.tokens_per_s_per_gpu if result.plan.speed else 0.0
        return (speed, result.seq_len) if objective == "speed" else (result.seq_len, speed)

    tp, best = max(found.items(), key=lambda item: rank(item[1]))
    knob = _tensor_parallel_knob(tuple(found))
    return dataclasses.replace(
        best,
        settings={TENSOR_PARALLEL: tp, **best.settings},
        searched=[knob, *best.searched],
        not_searched={n: w for n, w in best.not_searched.items() if n != TENSOR_PARALLEL},
        plans=[p for r in found.values() for p in r.plans],
        seconds=time.perf_counter() - started,
        traces=sum(r.traces for r in found.values()),
        by_tensor_parallel=results,
    )


def _find_at_one_degree(
    config: JobConfig,
    world_size: int | None,
    search: list[str] | None,
    *,
    budget: Budget,
    resolution: float,
    log: Callable[[str], None],
    objective: str,
    full_trace: bool,
) -> MaxContext:
    """``find_max_context`` at the job's own tensor-parallel degree."""
    started = time.perf_counter()
    traces = TraceCache(size=8)
    recipe_world = config.parallelism.world_size
    world_size = world_size or recipe_world
    try:
        base = on_world(config, world_size, budget.gpus_per_node)
    except ConfigError as err:
        worlds = _valid_worlds(config, budget.gpus_per_node, max(64, 4 * world_size))
        raise ConfigError(
            f"{err}; world sizes that work for this model: {', '.join(map(str, worlds))}"
        ) from None
    available = knobs(base)
    if search is not None:
        for name in search:
            if not isinstance(available[name], Knob):
                searchable = ", ".join(n for n, k in available.items() if isinstance(k, Knob))
                raise ConfigError(
                    f"--search {name}: does not apply here ({available[name]}); "
                    f"searchable now: {searchable}"
                )
    chosen = [
        k for n, k in available.items() if isinstance(k, Knob) and (search is None or n in search)
    ]
    not_searched = {
        n: k if isinstance(k, str) else "not in --search"
        for n, k in available.items()
        if not any(n == c.name for c in chosen)
    }
    recipe_keep = base.activation_checkpoint.keep_attention
    granule = GRANULE_TOKENS_PER_RANK * world_size
    start = config.training.seq_len * world_size // recipe_world
    history: list[tuple[dict[str, Any], Plan]] = []

    def configured(settings: dict[str, Any], seq_len: int) -> JobConfig:
        result = _replace(base, "training", seq_len=seq_len)
        for knob in chosen:
            result = knob.apply(result, settings[knob.name])
        return result

    def plan_at(settings: dict[str, Any], seq_len: int) -> Plan:
        traced, planning = traces.traces, time.perf_counter()
        plan = plan_job(
            configured(settings, seq_len),
            budget,
            world_size,
            full_trace=full_trace,
            traces=traces,
        )
        history.append((dict(settings), plan))
        speed = f", {plan.speed.tokens_text()}" if plan.speed else ""
        how = "traced" if traces.traces > traced else "from an earlier trace"
        took = f" [{how}, {time.perf_counter() - planning:.0f} s]"
        log(
            f"  {seq_len:>12,} tokens, "
            f"{describe(settings, chosen, recipe_keep) or 'recipe settings'}: "
            f"{plan.device_peak_bytes / GiB:7.2f} GiB device, "
            f"{plan.host_per_node_bytes / GiB:8.1f} GiB "
            f"host/node -> {plan.verdict}{speed}{took}"
        )
        return plan

    def longest(settings: dict[str, Any], known: Plan) -> tuple[int, list[Plan]]:
        return longest_fitting(
            lambda s: plan_at(settings, s),
            budget,
            start=known.seq_len,
            granule=granule,
            resolution=resolution,
            known=known,
        )

    settings = {knob.name: knob.values[0] for knob in chosen}
    if objective != "speed":  # the length search moves in granules; a speed search stays put
        start = max(granule, start // granule * granule)
    check_job(configured(settings, start), world_size)  # bad geometry fails before any plan
    offload = next((k.values for k in chosen if k.name == "fsdp_cpu_offload"), None)
    refuse_impossible(
        base, world_size, budget, offload or (base.training.enable_cpu_offload,)
    )  # a budget below the memory floor fails in seconds, not after a search
    if objective == "speed":
        best = start
        found = plan_at(settings, best)
        plans = [found]
        if not found.fits:
            raise DoesNotFit(
                f"{best:,} tokens do not fit even with every searched setting at its most "
                "memory-saving value: " + found.render()
            )
    else:
        first = plan_at(settings, start)
        chunks = next((knob for knob in chosen if knob.name == "sequence_chunks"), None)
        while chunks is not None and settings[chunks.name] != chunks.values[-1]:
            # More chunks than the peak needs save nothing (it is outside attention), cost time, and
            # make each plan slower (n(n+1)/2 chunk pairs): start from the fewest that save as much.
            fewer = {
                **settings,
                chunks.name: chunks.values[chunks.values.index(settings[chunks.name]) + 1],
            }
            trial = plan_at(fewer, start)
            if (
                trial.device_peak_bytes > first.device_peak_bytes
                or trial.host_per_node_bytes > first.host_per_node_bytes
            ):
                break
            settings, first = fewer, trial
        best, plans = longest(settings, first)
        host_bound = limit_of(best, plans) == "host memory"
        # The settings that trade device memory for host memory, switched the other way.
        trade, why = (
            ("fsdp_cpu_offload", "host memory: searching again without FSDP CPU offload")
            if host_bound
            else (
                "blocks_per_checkpoint",
                "device memory: searching again checkpointing each block",
            )
        )
        knob = next((k for k in chosen if k.name == trade), None)
        if knob is not None and settings[trade] == knob.values[0]:
            log(f"  the limit is {why}")
            other = {**settings, trade: knob.values[1]}
            there = plan_at(other, max(best, granule))
            # Memory grows with the length: not fitting at the length found, the other way
            # cannot go longer, and its own limit is not searched.
            longer, more = longest(other, there) if there.fits else (0, [there])
            if longer > best:
                best, plans, settings = longer, more, other
        if best == 0:
            raise DoesNotFit(
                f"not even {granule:,} tokens fit {budget.device_bytes / GiB:g} GiB per GPU and "
                f"{budget.host_bytes_per_node / GiB:g} GiB host per node: "
                + min(plans, key=lambda p: p.seq_len).render()
            )
        found = next(p for p in reversed(plans) if p.seq_len == best and p.fits)

    def relax(knob: Knob, settings: dict[str, Any], found: Plan) -> tuple[dict[str, Any], Plan]:
        """One value further at a time while it fits, kept where no slower. Where the attention
        is kept, each place is first given as many keeping blocks as fit there, then compared:
        four blocks kept on the device may fit and be as fast as four on the host, yet the host
        may have room for sixteen."""
        blocks = next((k for k in chosen if k.name == "kept_layers"), None)
        for value in knob.values[knob.values.index(settings[knob.name]) + 1 :]:
            trial = {**settings, knob.name: value}
            if knob.name == "keep_attention" and blocks is not None:
                trial[blocks.name] = blocks.values[0]  # each place from its fewest blocks
            plan = plan_at(trial, best)
            if not plan.fits:
                if knob.name == "keep_attention":
                    continue  # the host's memory is not the device's: try the next place
                break
            if knob.name == "keep_attention" and blocks is not None:
                trial, plan = relax(blocks, trial, plan)
            if _no_slower(plan, found):
                settings, found = trial, plan
        return settings, found

    searched = {knob.name for knob in chosen}
    for knob in chosen:
        joint = knob.name == "kept_layers" and "keep_attention" in searched  # relaxed with it
        if not joint and not _inert(knob.name, settings, recipe_keep):
            settings, found = relax(knob, settings, found)
    return MaxContext(
        configured(settings, best),
        found,
        settings,
        chosen,
        not_searched,
        history,
        time.perf_counter() - started,
        limit_of(best, plans),
        objective,
        traces.traces,
    )


def _no_slower(plan: Plan, than: Plan) -> bool:
    """Whether ``plan`` is predicted at least as fast as ``than`` by the central values (True
    without predictions)."""
    if plan.speed is None or than.speed is None:
        return True
    return plan.speed.step_time_s <= than.speed.step_time_s


def limit_of(best: int, plans: list[Plan]) -> str:
    """What stops a context longer than ``best``: ``Plan.exceeds`` of the shortest plan above it
    that does not fit ("" if none was made)."""
    above = [p for p in plans if p.seq_len > best and not p.fits]
    return min(above, key=lambda p: p.seq_len).exceeds if above else ""


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value:_}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _extended(config: JobConfig, recipe: Path, keys: list[str]) -> tuple[str, list[str]]:
    """The file a printed recipe extends (relative to ``recipe``'s folder, where it is saved;
    "" for none) and the keys it must set again besides ``keys``: the given recipe itself,
    unless a key the search unsets (a style option now at its default, e.g. sequence chunks on a
    ring) is set in it or a file it extends. A file cannot unset a key it inherits, so the
    printed recipe then extends the base of the first file that sets one, and sets again every
    other key that file and those after it set."""
    files = list(config.files)
    unset = [key for key in keys if config.value(key) is None and config.sources.get(key) in files]
    if not unset:
        return recipe.name, []
    first = min(files.index(config.sources[key]) for key in unset)
    again = [
        key
        for key, source in config.sources.items()
        if source in files[first:] and key not in keys and config.value(key) is not None
    ]
    if first == 0:
        return "", again
    base = Path(files[first - 1]).resolve()
    return os.path.relpath(base, recipe.resolve().parent), again


def _reached(found: MaxContext | str) -> str:
    """What one tensor-parallel degree's search reached, in words (or why it could not run)."""
    if isinstance(found, str):
        return found
    speed = f", {found.plan.speed.tokens_text()}" if found.plan.speed else ""
    return f"{found.seq_len:,} tokens{speed}"


def recipe_toml(result: MaxContext, command: str) -> str:
    """A recipe that extends the given one with the length and settings found, the plan's numbers
    in comments (a file to save next to the given recipe), then the plan's breakdown as comments."""
    config, plan, budget = result.config, result.plan, result.plan.budget
    keys = [
        "training.seq_len",
        "parallelism.context_parallel_degree",  # what ``on_world`` sets
        "parallelism.data_parallel_shard_degree",
        "parallelism.ring_degree",
    ]
    if config.parallelism.style.takes("chunk_tokens"):
        keys.append("parallelism.chunk_tokens")  # ``on_world`` unsets it on a ring
    keys += [key for knob in result.searched for key in knob.keys if key not in keys]
    keys += [
        key
        for key, source in config.sources.items()
        if source == "command line" and key not in keys
    ]
    folder = config.job.dump_folder  # kept if given on the command line, else a folder of its own
    if config.sources.get("job.dump_folder") != "command line":
        folder = folder.rstrip("/") + "_max_context"
    sections: dict[str, list[str]] = {"job": [f"dump_folder = {_toml_value(folder)}"]}
    for key in keys:
        section, name = key.split(".")
        value = config.value(key)
        if key != "job.dump_folder":
            sections.setdefault(section, []).append(
                f"# {name} unset: cp_style's default"
                if value is None
                else f"{name} = {_toml_value(value)}"
            )
    recipe = Path(config.config_file or "recipe.toml")
    extends, inherited = _extended(config, recipe, keys)
    for key in inherited:
        if key == "job.dump_folder":  # set above, in every printed recipe
            continue
        section, name = key.split(".")
        sections.setdefault(section, []).append(f"{name} = {_toml_value(config.value(key))}")
    nodes = -(-plan.world_size // budget.gpus_per_node)
    goal = (
        "The fastest settings the planner finds"
        if result.objective == "speed"
        else "The longest context the planner finds"
    )
    speed = (
        f" Predicted: {plan.speed.tokens_text()} on {plan.speed.profile} (central value; the "
        "band has every rate at the ends of its range)."
        if plan.speed
        else ""
    )
    header = [
        f"{goal} for [model] flavor {config.model.flavor!r} on "
        f"{plan.world_size} GPUs ({nodes} node{'s' if nodes > 1 else ''} of "
        f"{min(plan.world_size, budget.gpus_per_node)}) with {budget.device_bytes / GiB:g} GiB "
        "each and "
        f"{budget.host_bytes_per_node / GiB:g} GiB host RAM per node: {plan.seq_len:,} tokens "
        f"({plan.seq_len / 2**20:.2f}M), {plan.attention}.",
        f"Planner: peak {plan.device_peak_bytes / GiB:.2f} GiB per GPU ({plan.device_peak_when}), "
        f"host {plan.host_per_node_bytes / GiB:,.1f} GiB per node"
        + (f"; a longer context exceeds {result.limited_by}." if result.limited_by else ".")
        + speed,
        f"Found by: {command} ({len(result.plans)} plans, {result.traces} traced, "
        f"{result.seconds / 60:.1f} min).",
        *(
            [
                "Tensor-parallel degrees: "
                + "; ".join(
                    f"tp {tp}: {_reached(found)}" for tp, found in result.by_tensor_parallel.items()
                )
                + "."
            ]
            if result.by_tensor_parallel
            else []
        ),
        "Searched, most memory-saving first: "
        + "; ".join(f"{k.name} {', '.join(k.show(v) for v in k.values)}" for k in result.searched)
        + ".",
        *(
            [
                "Not searched: "
                + "; ".join(f"{n} ({why})" for n, why in result.not_searched.items())
                + "."
            ]
            if result.not_searched
            else []
        ),
        f"Save it next to {recipe} ('extends' is relative to this file)."
        + (
            f" It extends {recipe}'s base and sets its keys again, as a file cannot unset a key "
            "it inherits."
            if extends != recipe.name
            else ""
        ),
    ]
    lines = [
        f"# {line}"
        for paragraph in header
        for line in textwrap.wrap(paragraph, 98, break_on_hyphens=False)
    ]
    if extends:
        lines.append(f"extends = {_toml_value(extends)}")
    for section in (f.name for f in dataclasses.fields(JobConfig)):
        if section in sections:
            lines += ["", f"[{section}]", *sections[section]]
    lines += ["", *(f"# {line}" for line in plan.render().splitlines())]
    return "\n".join(lines) + "\n"
