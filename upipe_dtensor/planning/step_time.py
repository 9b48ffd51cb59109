"""How long one training step takes: the traced step's counted work (``step_work``) priced with a
hardware profile (``hardware``), with the overlap rules of the code as it runs today.

Every prediction is a central value and a band: the same work priced with every constant at the
central value of its range, and at the slow and fast ends of all ranges at once
(``HardwareProfile.at``; an outer band, the errors of every constant aligned). The central value
is what ``--objective speed`` ranks by.

Time on one rank, all ranks of a CP job doing the same work:

- compute, serial on the compute stream: matmul FLOPs / achieved matmul FLOP/s + attention FLOPs
  / the kernel's FLOP/s (forward causal, forward full, backward; FlashAttention's counting) +
  the bytes of every other op / memory bandwidth + a fixed cost per op (the gap between
  back-to-back kernels on a GPU; measured on CPU);
- head all-to-alls, each call taking its bytes / bandwidth plus a fixed latency: with UPipe's
  overlapped stages (``overlap_stages``, n > 1 stages per pass) stage s+1's exchanges are posted
  before stage s's attention and stage s's outputs before stage s+1's
  (``parallel/staged_attention.py``): per stage c = (all-to-all + latency) / n seconds against
  a = attention / n, the first stage of each pass waits whole and every other stage waits for
  what its neighbour's attention does not cover: overlapped = c + (n - 1) max(0, c - a). That
  holds only for the exchanges whose NCCL kernel gets SMs while the attention kernel runs (a
  share ``overlap_share`` of them; FA3's forward kernel is persistent, one CTA per SM, and an
  exchange that reaches the GPU after it waits for its end), and the hidden time h costs the
  attention the SMs NCCL holds (``nccl_sm_share``): exposed = s (overlapped + k h) +
  (1 - s) x all, s the overlap share and k the SM share. Ulysses (one stage), FPDT and UPipe
  with ``overlap_stages = false`` wait for each exchange before the op that uses it: exposed
  whole;
- FA3's ``sm_margin`` (torch 2.13's FA3 registry passes ``torch._C._get_sm_carveout_experimental()``
  to both FA3 kernels): reserving NCCL's SMs would let every overlapped exchange run (s = 1, no
  contention) but slow all attention by k / (1 - k); ``StepTime.sm_margin_saves_s`` says what it
  would save (negative: it costs), and the code does not set it;
- ring point-to-point (ring attention, 2D): posted before a block's kernel and waited after it
  (``parallel/ring.py``): the same rule with overlapped = max(0, ring - attention) and
  h = min(ring, attention) (NCCL's SM share charged across nodes too, where it uses fewer SMs);
- FSDP2's all-gathers and reduce-scatters: on their own streams, issued at block boundaries, the
  next block's all-gather prefetched while the current block computes and each reduce-scatter
  overlapping the next block's backward, so exposed = max(0, FSDP - compute) + one all-gather
  (the step's first, which nothing precedes) + k min(FSDP, compute) (the SMs the hidden part
  holds); all-reduces (loss, gradient norm) exposed;
- tensor parallelism's collectives (each block's input all-gathered over tp before its
  attention and MLP, their outputs reduce-scattered, the reverse in backward; the embeddings'
  and the replicated weights' reductions): on the compute stream, between the ops that produce
  and use them, so exposed whole (torchtitan's async TP, which overlaps them with the matmuls, is
  not used);
- expert parallelism's token exchanges (each MoE block's dispatch and combine all-to-alls over
  the ep group, and the token counts before them): exposed whole, since torchtitan's dispatcher
  reads the counts on the host and waits for each exchange before the experts or the combine
  run (no overlap with other work); sized for evenly routed tokens (``plan_job``);
- host <-> device copies share the host link (``host_link_bytes_per_s`` per GPU, all GPUs
  copying at once) on copy engines (no SMs): side-stream copies overlap compute, except the
  block inputs fetched back in backward when ``cpu_offload_prefetch`` is off, which the compute
  stream waits for, and both directions of the block inputs when they are copied on the compute
  stream (``StepShape.offload_on_compute_stream``: the UPipe paper's ``save_on_cpu``);
  exposed = waited copies + max(0, the others - compute). FSDP CPU offload adds the fp32
  parameter shards' host-to-device copies (each all-gather) and the gradients' way back;
- the optimizer, after backward: on the GPU AdamW reads and writes 28 bytes per parameter of the
  shard (fp32 parameter, gradient, two moments); offloaded, the host runs it at
  ``host_adamw_params_per_s``.

Not modelled: HBM contention from concurrent NCCL kernels, contention between concurrent
collectives on one link, the CPU work of Python between kernels, host syncs, stragglers. MFU is
printed two ways: causal-aware (attention counted at the half of the square a causal mask
computes) and torchtitan's (``get_dense_model_nparams_and_flops``: the full square).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

from upipe_dtensor.planning.hardware import HardwareProfile
from upipe_dtensor.planning.step_work import (
    EXPERT_PARALLEL_KINDS,
    TENSOR_PARALLEL_KINDS,
    StepWork,
)

ADAMW_BYTES_PER_PARAM = 28
"""fp32 parameter (read, write), gradient (read), two moments (read, write each): 7 x 4 bytes."""


@dataclass(frozen=True)
class StepShape:
    """What the model needs to know of the job besides the counted work."""

    backend: str
    """The attention backend the flash-family ops run (fa3, fa4, flash, sdpa) or "cpu"."""
    tokens_per_gpu: int
    """Tokens one rank trains on per step (local batch x accumulation x seq_len / cp)."""
    local_params: int
    """This rank's share of the parameters (the optimizer's work)."""
    optimizer_on_host: bool
    """FSDP CPU offload: the optimizer runs on the host, fp32 shards cross the host link."""
    all_gathers_per_step: int
    """How many times each parameter is gathered per step (2 with reshard after forward)."""
    block_inputs_prefetched: bool
    flops_per_token_causal: float
    flops_per_token_torchtitan: float
    overlapped_stages: int = 1
    """n, the head stages per pass whose all-to-alls overlap attention (1: each waited at once,
    as in the paper's code and in Ulysses)."""
    offload_on_compute_stream: bool = False
    """The block inputs' host copies run on the compute stream both ways, each waited for (the
    UPipe paper's ``torch.autograd.graph.save_on_cpu``); False: this repository's offload, on
    side streams (``runtime/host_store.py``)."""


@dataclass
class StepTime:
    """The predicted step of one rank; seconds, and throughput per GPU. The scalars are the
    central prediction; the ranges are the band of the profile's ranges (module docstring)."""

    profile: str
    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    """Causal-aware model FLOPs utilisation."""
    mfu_torchtitan: float
    time_breakdown_s: dict[str, float]
    compute_s: dict[str, float]
    """Compute by kind: matmul, attention forward, attention backward, memory-bound ops."""
    work: dict[str, float]
    """What was counted in the traced step (``StepWork.summary``)."""
    counted: StepWork = field(repr=False)
    shape: StepShape = field(repr=False)
    """The inputs of the prediction, to price the same step on another profile."""
    step_time_range_s: tuple[float, float] = (0.0, 0.0)
    """(fast end, slow end): every constant at the fast, then the slow end of its range."""
    tokens_per_s_per_gpu_range: tuple[float, float] = (0.0, 0.0)
    """(low, high): tokens per GPU over the slow, then the fast end's step time."""
    sm_margin_saves_s: float = 0.0
    """With overlapped stages: what reserving NCCL's SMs through FA3's ``sm_margin`` would save
    (central values; negative: it costs). 0 without overlapped stages."""

    def tokens_text(self) -> str:
        """The throughput in words: central value and band."""
        low, high = self.tokens_per_s_per_gpu_range
        return f"{self.tokens_per_s_per_gpu:,.1f} tokens/s per GPU (band {low:,.1f}-{high:,.1f})"

    def as_dict(self) -> dict:
        """The reported fields (numbers and flat dicts of them), without the inputs."""
        reported = (f.name for f in fields(self) if f.name not in ("counted", "shape"))
        return {name: copy.copy(getattr(self, name)) for name in reported}

    def render(self) -> list[str]:
        """Lines for the plan's report."""
        fast, slow = self.step_time_range_s
        low, high = self.tokens_per_s_per_gpu_range
        lines = [
            f"  step time ({self.profile}, predicted): {_seconds(self.step_time_s)} "
            f"({_seconds(fast)} to {_seconds(slow)}), {self.tokens_per_s_per_gpu:,.1f} tokens/s "
            f"per GPU ({low:,.1f} to {high:,.1f}), MFU {self.mfu:.1%} (causal attention counted "
            f"at half its square; torchtitan's formula, which counts the whole square: "
            f"{self.mfu_torchtitan:.1%})",
            "    central value; in brackets the band with every constant at the ends of its range",
        ]
        for label, seconds in self.time_breakdown_s.items():
            share = seconds / self.step_time_s if self.step_time_s else 0.0
            lines.append(f"    {label:<42s} {_seconds(seconds):>10s}  {share:6.1%}")
            if label == "compute":
                for kind, part in self.compute_s.items():
                    lines.append(f"      {kind:<40s} {_seconds(part):>10s}")
        if self.sm_margin_saves_s < 0:
            lines.append(
                f"    FA3 sm_margin for NCCL's SMs would cost {_seconds(-self.sm_margin_saves_s)}"
                " more: not set"
            )
        elif self.sm_margin_saves_s > 0:
            lines.append(
                f"    FA3 sm_margin for NCCL's SMs would save {_seconds(self.sm_margin_saves_s)}"
                " (not set by this repository: torch._C._set_sm_carveout_experimental)"
            )
        return lines


def _seconds(value: float) -> str:
    """Seconds or milliseconds, three significant digits."""
    return f"{value:.3g} s" if value >= 1 else f"{value * 1e3:.3g} ms"


def _comm_seconds(work: StepWork, profile: HardwareProfile, *kinds: str) -> tuple[float, int]:
    """(seconds on the wire, calls) of these kinds of collective (of one rate)."""
    intra = {
        "all_to_all": profile.all_to_all_bus_bytes_per_s,
        "ep all_to_all": profile.all_to_all_bus_bytes_per_s,
        "p2p": profile.p2p_bytes_per_s,
    }.get(kinds[0], profile.collective_bus_bytes_per_s)
    seconds, calls = 0.0, 0
    for (name, crosses), traffic in work.communication.items():
        if name in kinds:
            rate = profile.inter_node_bytes_per_s if crosses else intra
            seconds += traffic.bytes / rate
            calls += traffic.calls
    return seconds, calls


def _overlapped(total: float, overlapped: float, profile: HardwareProfile) -> float:
    """Exposed seconds of an exchange of ``total`` seconds that ``overlapped`` would leave exposed
    if its kernel got SMs beside the attention kernel: the overlap share of the exchanges do
    (their hidden time costs the attention NCCL's share of the SMs), the rest wait whole."""
    hidden = total - overlapped
    share = profile.overlap_share
    return share * (overlapped + profile.nccl_sm_share * hidden) + (1 - share) * total


@dataclass
class _Priced:
    breakdown: dict[str, float]
    compute: dict[str, float]
    sm_margin_saves_s: float

    @property
    def step_s(self) -> float:
        return sum(self.breakdown.values())


def _price(work: StepWork, shape: StepShape, profile: HardwareProfile) -> _Priced:
    """The step's time on one profile, by the rules of the module docstring."""
    attention = {"forward causal": 0.0, "forward full": 0.0, "backward": 0.0}
    for (family, direction), flops in work.attention_flops.items():
        kernel = shape.backend if family == "flash" else family
        rates = profile.attention_rates(kernel)
        rate = {
            "forward causal": rates.forward_causal,
            "forward full": rates.forward_full,
            "backward": rates.backward,
        }[direction]
        attention[direction] += flops / rate
    compute = {
        "matmul": work.matmul_flops / profile.matmul_flops,
        "attention forward": attention["forward causal"] + attention["forward full"],
        "attention backward": attention["backward"],
        "memory-bound ops": work.memory_bytes / profile.memory_bytes_per_s,
        "op dispatch": work.ops * profile.op_overhead_s,
    }
    compute_s = sum(compute.values())
    attention_s = compute["attention forward"] + compute["attention backward"]

    a2a_s, a2a_calls = _comm_seconds(work, profile, "all_to_all")
    ring_s, _ = _comm_seconds(work, profile, "p2p")
    gather_s, gather_calls = _comm_seconds(work, profile, "all_gather")
    scatter_s, _ = _comm_seconds(work, profile, "reduce_scatter")
    # broadcasts, gathers, barriers ("other") are waited for whole, as an all-reduce is
    reduce_s, reduce_calls = _comm_seconds(work, profile, "all_reduce", "other")
    first_gather = gather_s / gather_calls if gather_calls else 0.0
    fsdp_s = gather_s + scatter_s
    fsdp_exposed = (
        max(0.0, fsdp_s - compute_s) + first_gather + profile.nccl_sm_share * min(fsdp_s, compute_s)
    )

    host = work.host_bytes
    shard_bytes = 4 * shape.local_params
    host_rate = profile.host_link_bytes_per_s
    offload_back = host.get(("activation offload", "to device"), 0.0)
    waited = 0.0 if shape.block_inputs_prefetched else offload_back
    if shape.offload_on_compute_stream:
        waited = offload_back + host.get(("activation offload", "to host"), 0.0)
    overlapped = sum(host.values()) - waited
    if shape.optimizer_on_host:
        overlapped += shard_bytes * (shape.all_gathers_per_step + 1)
        optimizer_s = shape.local_params / profile.host_adamw_params_per_s
    else:
        optimizer_s = ADAMW_BYTES_PER_PARAM * shape.local_params / profile.memory_bytes_per_s
    host_exposed = waited / host_rate + max(0.0, overlapped / host_rate - compute_s)

    stages = shape.overlapped_stages
    a2a_s += a2a_calls * profile.collective_latency_s
    a2a_exposed, margin_saves = a2a_s, 0.0
    if stages > 1:
        a2a_stage, attention_stage = a2a_s / stages, attention_s / stages
        staged = a2a_stage + (stages - 1) * max(0.0, a2a_stage - attention_stage)
        a2a_exposed = _overlapped(a2a_s, staged, profile)
        reserved = profile.nccl_sm_share
        margin_saves = a2a_exposed - (staged + attention_s * reserved / (1 - reserved))

    tp_s, tp_calls = _comm_seconds(work, profile, *TENSOR_PARALLEL_KINDS)
    breakdown = {
        "compute": compute_s,
        "exposed head all-to-all": a2a_exposed,
        "exposed ring p2p": _overlapped(ring_s, max(0.0, ring_s - attention_s), profile),
        "exposed FSDP collectives": fsdp_exposed + reduce_s,
        "exposed host transfers": host_exposed,
        "optimizer": optimizer_s,
        "all-reduce latency": reduce_calls * profile.collective_latency_s,
    }
    if tp_calls:  # only a tensor-parallel job has the row (tp = 1 plans are as before)
        breakdown["exposed tensor-parallel collectives"] = (
            tp_s + tp_calls * profile.collective_latency_s
        )
    ep_s, ep_calls = _comm_seconds(work, profile, *EXPERT_PARALLEL_KINDS)
    if ep_calls:  # torchtitan's dispatcher waits for its token counts, then for each exchange
        breakdown["exposed expert all-to-all"] = ep_s + ep_calls * profile.collective_latency_s
    return _Priced(breakdown, compute, margin_saves)


def predict_step_time(work: StepWork, shape: StepShape, profile: HardwareProfile) -> StepTime:
    """The step's time, central and band (module docstring)."""
    central = _price(work, shape, profile)
    ends = [_price(work, shape, profile.at(end)) for end in ("fast", "slow")]
    step = central.step_s
    tokens = shape.tokens_per_gpu
    fast, slow = (priced.step_s for priced in ends)
    return StepTime(
        profile=profile.name,
        step_time_s=step,
        tokens_per_s_per_gpu=tokens / step if step else 0.0,
        mfu=tokens * shape.flops_per_token_causal / (step * profile.peak_flops) if step else 0.0,
        mfu_torchtitan=tokens * shape.flops_per_token_torchtitan / (step * profile.peak_flops)
        if step
        else 0.0,
        time_breakdown_s=central.breakdown,
        compute_s=central.compute,
        work=work.summary(),
        counted=work,
        shape=shape,
        step_time_range_s=(fast, slow),
        tokens_per_s_per_gpu_range=(tokens / slow if slow else 0.0, tokens / fast if fast else 0.0),
        sm_margin_saves_s=central.sm_margin_saves_s,
    )


def speedup(top: StepTime, bottom: StepTime) -> tuple[float, float, float]:
    """(central, low, high) of ``top``'s tokens/s over ``bottom``'s, each end of the band from
    both steps priced at the same end of the same ranges (the ratio of like with like; the two
    ends' ratios, ordered)."""
    central = top.tokens_per_s_per_gpu / bottom.tokens_per_s_per_gpu
    pairs = zip(top.tokens_per_s_per_gpu_range, bottom.tokens_per_s_per_gpu_range)
    ends = [t / b for t, b in pairs]
    return central, min(ends), max(ends)
