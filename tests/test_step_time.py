"""The step-time model: what the traced step counts, checked against references we did not write
(torch's FlopCounterMode, a brute-force causal mask, torchtitan's parameter count, the
communication formulas that test_communication.py checks byte for byte on gloo), and the overlap
rules on hand-made work."""

from __future__ import annotations

from dataclasses import fields as dataclass_fields
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from upipe_dtensor.config import parse_args
from upipe_dtensor.models import get_family
from upipe_dtensor.models.hf_config import model_args
from upipe_dtensor.planning.communication_volume import layer_traffic
from upipe_dtensor.planning.hardware import (
    ENDS,
    GPU_PROFILES,
    H100_SXM,
    H200,
    AttentionRates,
    HardwareProfile,
)
from upipe_dtensor.planning.step import plan_job
from upipe_dtensor.planning.step_time import StepShape, predict_step_time, speedup
from upipe_dtensor.planning.step_work import StepWork, Traffic, attention_flops, visible_pairs

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "train_configs/debug_model.toml")


@pytest.mark.parametrize("seq_q,seq_k", [(7, 7), (3, 9), (9, 3), (1, 5), (6, 1)])
def test_visible_pairs_match_the_causal_mask(seq_q: int, seq_k: int) -> None:
    mask = torch.ones(seq_q, seq_k).tril(diagonal=seq_k - seq_q)  # aten's bottom-right alignment
    assert visible_pairs(seq_q, seq_k, causal=True) == int(mask.sum())
    assert visible_pairs(seq_q, seq_k, causal=False) == seq_q * seq_k


def test_attention_flops_match_flop_counter_mode_for_a_full_block() -> None:
    """torch's own formula for the (B, h, S, d) SDPA ops, forward and backward; a causal call
    counts only its visible pairs (FlopCounterMode counts the square either way)."""
    batch, heads, seq, dim = 2, 4, 96, 32
    with FakeTensorMode():
        q, k, v = (torch.empty(batch, heads, seq, dim) for _ in range(3))
        counter = FlopCounterMode(display=False)
        with counter:
            out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, False
            )
            seed = torch.empty((), dtype=torch.long)
            torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                out, q, k, v, None, out, lse, seed, seed, 0.0, [True] * 3 + [False], False
            )
    counts = {op.__name__: flops for op, flops in counter.get_flop_counts()["Global"].items()}
    forward = torch.ops.aten._scaled_dot_product_efficient_attention.default
    backward = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
    assert attention_flops(forward, (q, k, v, None, True, 0.0, False)) == (
        "efficient",
        "forward full",
        counts["_scaled_dot_product_efficient_attention"],
    )
    args = (out, q, k, v, None, out, lse, None, None, 0.0, None, False)
    assert (
        attention_flops(backward, args)[2]
        == counts["_scaled_dot_product_efficient_attention_backward"]
    )
    causal = attention_flops(forward, (q, k, v, None, True, 0.0, True))
    assert causal[1] == "forward causal"
    assert causal[2] == 4 * batch * heads * dim * seq * (seq + 1) // 2


def _debug_plan(*extra: str):
    config = parse_args(["--config", DEBUG, "--training.seq_len", "512", *extra])
    return config, plan_job(config)


def test_matmul_flops_are_six_per_parameter_and_token_without_recompute() -> None:
    """No activation checkpointing: every Linear of torchtitan's model does 2 FLOPs per weight and
    token forward and 4 backward, however the attention op, the MLP tiles and the loss chunks
    run them (torchtitan's 6 N per token), plus 2 per token for wq, wk and wv, which the
    attention op projects again in its backward instead of saving Q, K, V. The model is the
    job's family's, torchtitan's model class of the installed generation (0.3.0 holds wq, wk and
    wv in the attention's ``qkv_linear``)."""
    config, plan = _debug_plan(
        "--parallelism.cp_style", "ulysses", "--activation_checkpoint.mode", "none"
    )
    args = model_args(config.model, 512)
    with torch.device("meta"):
        model = get_family(config.model.name).model_class(args)
    linear_params = sum(
        module.weight.numel() for module in model.modules() if isinstance(module, nn.Linear)
    )
    projections = [
        module.weight.numel()
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in ("wq", "wk", "wv")
    ]
    assert len(projections) == 3 * args.n_layers
    tokens = config.training.local_batch_size * 512 // config.parallelism.context_parallel_degree
    assert plan.speed.work["matmul FLOPs"] == (6 * linear_params + 2 * sum(projections)) * tokens


@pytest.mark.parametrize("style", ["upipe", "ulysses"])
def test_all_to_all_bytes_equal_the_communication_formulas(style: str) -> None:
    """The bytes the trace sends equal ``layer_traffic`` (full checkpointing: forward, recompute,
    backward), the formulas test_communication.py checks against counted gloo sends."""
    config, plan = _debug_plan(
        "--parallelism.cp_style", style, "--activation_checkpoint.mode", "full"
    )
    args = model_args(config.model, 512)
    traffic = layer_traffic(
        style,
        seq_len=512,
        batch=config.training.local_batch_size,
        cp=2,
        ring_degree=1,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads or args.n_heads,
        head_dim=args.dim // args.n_heads,
        heads_per_stage=2 if style == "upipe" else args.n_heads,
        dtype_bytes=2,
    )
    all_to_all, _ = traffic.per_step(recompute=True)
    assert plan.speed.work["all_to_all bytes, inside a node"] == args.n_layers * all_to_all


def test_ring_hides_behind_attention_and_counts_its_sends() -> None:
    _, plan = _debug_plan("--parallelism.cp_style", "ring")
    assert plan.speed.work["p2p bytes, inside a node"] > 0
    assert "all_to_all bytes, inside a node" not in plan.speed.work
    assert plan.speed.time_breakdown_s["exposed head all-to-all"] == 0


def test_planner_json_has_the_speed_fields() -> None:
    _, plan = _debug_plan()
    report = plan.as_dict()
    assert report["step_time_s"] == pytest.approx(sum(report["time_breakdown_s"].values()))
    tokens = 4 * 512 // 2
    assert report["tokens_per_s_per_gpu"] == pytest.approx(tokens / report["step_time_s"])
    assert 0 < report["mfu"] < report["speed"]["mfu_torchtitan"]
    low, high = report["tokens_per_s_per_gpu_range"]
    fast, slow = report["step_time_range_s"]
    assert low < report["tokens_per_s_per_gpu"] < high
    assert (low, high) == pytest.approx((tokens / slow, tokens / fast))
    _, tp2 = _debug_plan("--parallelism.tensor_parallel_degree", "2")  # the 2 cp ranks x tp 2
    speed = tp2.as_dict()
    assert speed["tokens_per_s_per_gpu"] == pytest.approx(tokens / 2 / speed["step_time_s"])


def _shape(**changes) -> StepShape:
    values = dict(
        backend="fa3",
        tokens_per_gpu=1000,
        local_params=10**9,
        optimizer_on_host=False,
        all_gathers_per_step=2,
        block_inputs_prefetched=True,
        flops_per_token_causal=1e9,
        flops_per_token_torchtitan=2e9,
    )
    return StepShape(**{**values, **changes})


def _work(**changes) -> StepWork:
    work = StepWork(
        matmul_flops=792e12,  # 1 s on H100
        attention_flops={("flash", "forward causal"): 616e12, ("flash", "backward"): 561e12},
        memory_bytes=0.0,
    )
    for name, value in changes.items():
        setattr(work, name, value)
    return work


UNIT = replace(
    H100_SXM,
    matmul_flops=792e12,
    memory_bytes_per_s=3350e9,
    attention={"fa3": AttentionRates(616e12, 648e12, 561e12, "test")},
    all_to_all_bus_bytes_per_s=335e9,
    collective_bus_bytes_per_s=370e9,
    p2p_bytes_per_s=370e9,
    inter_node_bytes_per_s=47e9,
    collective_latency_s=11e-6,
    host_link_bytes_per_s=26e9,
    host_adamw_params_per_s=300e6,
    op_overhead_s=0.0,
    overlap_share=1.0,
    nccl_sm_share=0.0,
    ranges={},
)
"""Round rates, every overlapped exchange on its own SMs: the rules one at a time."""


def test_overlap_rules() -> None:
    """Compute 3 s (1 s matmul, 2 s FA3 attention); each rule of step_time's docstring."""
    H100_SXM = UNIT  # noqa: N806 (the rates these numbers are written for)
    base = predict_step_time(_work(), _shape(), H100_SXM)
    assert base.time_breakdown_s["compute"] == pytest.approx(3.0)
    assert base.compute_s["attention forward"] == pytest.approx(1.0)
    exposed = base.time_breakdown_s
    communication = {
        ("all_to_all", False): Traffic(335e9, 10),  # 1 s on NVLink, all exposed
        ("p2p", True): Traffic(47e9 * 1.5, 4),  # 1.5 s across nodes, under 2 s of attention
        ("all_gather", False): Traffic(370e9 * 2, 2),  # 2 s, under 3 s of compute: 1 exposed
    }
    timed = predict_step_time(_work(communication=communication), _shape(), H100_SXM)
    parts = timed.time_breakdown_s
    latency = 10 * 11e-6  # 10 calls of 11 us each
    assert parts["exposed head all-to-all"] == pytest.approx(1.0 + latency)
    # Four overlapped stages: 0.25 s of exchanges per stage under 0.5 s of attention, so only
    # the first stage's wait shows (with its calls' latency); with 2.5 s of exchanges each later
    # stage shows 0.125 s more.
    staged = predict_step_time(
        _work(communication=communication), _shape(overlapped_stages=4), H100_SXM
    )
    assert staged.time_breakdown_s["exposed head all-to-all"] == pytest.approx((1.0 + latency) / 4)
    heavy = {("all_to_all", False): Traffic(335e9 * 2.5, 10)}
    staged = predict_step_time(_work(communication=heavy), _shape(overlapped_stages=4), H100_SXM)
    per_stage = (2.5 + latency) / 4
    assert staged.time_breakdown_s["exposed head all-to-all"] == pytest.approx(
        per_stage + 3 * (per_stage - 0.5)
    )
    assert parts["exposed ring p2p"] == 0
    assert parts["exposed FSDP collectives"] == pytest.approx(1.0)  # the first all-gather
    assert parts["all-reduce latency"] == 0
    slow_ring = {("p2p", True): Traffic(47e9 * 2.5, 4)}
    assert predict_step_time(_work(communication=slow_ring), _shape(), H100_SXM).time_breakdown_s[
        "exposed ring p2p"
    ] == pytest.approx(0.5)
    host = {("activation offload", "to device"): 26e9, ("activation offload", "to host"): 26e9}
    prefetched = predict_step_time(_work(host_bytes=host), _shape(), H100_SXM)
    assert prefetched.time_breakdown_s["exposed host transfers"] == 0
    waited = predict_step_time(
        _work(host_bytes=host), _shape(block_inputs_prefetched=False), H100_SXM
    )
    assert waited.time_breakdown_s["exposed host transfers"] == pytest.approx(1.0)
    assert exposed["optimizer"] == pytest.approx(28e9 / 3350e9)
    on_host = predict_step_time(_work(), _shape(optimizer_on_host=True), H100_SXM)
    assert on_host.time_breakdown_s["optimizer"] == pytest.approx(1e9 / 300e6)
    # The fp32 shards' copies (3 x 4 GB: two all-gathers, the gradients) hide behind 3 s of
    # compute, not behind 0.1 s.
    assert on_host.time_breakdown_s["exposed host transfers"] == 0
    short = _work(matmul_flops=79.2e12, attention_flops={})
    brief = predict_step_time(short, _shape(optimizer_on_host=True), H100_SXM)
    assert brief.time_breakdown_s["exposed host transfers"] == pytest.approx(12e9 / 26e9 - 0.1)
    assert base.mfu == pytest.approx(1000 * 1e9 / (base.step_time_s * 989e12))
    # H200: the same compute, faster memory.
    h100 = predict_step_time(_work(), _shape(), GPU_PROFILES["h100-sxm"])
    assert predict_step_time(_work(), _shape(), H200).step_time_s < h100.step_time_s
    # The paper's save_on_cpu: both directions of the block inputs waited on the compute stream.
    synchronous = predict_step_time(
        _work(host_bytes=host), _shape(offload_on_compute_stream=True), H100_SXM
    )
    assert synchronous.time_breakdown_s["exposed host transfers"] == pytest.approx(2.0)


def test_sm_contention_and_margin() -> None:
    """Half the overlapped exchanges get SMs and cost the attention a quarter of their hidden
    time; the other half wait whole. FA3's sm_margin would slow all attention by k / (1 - k)."""
    profile = replace(UNIT, overlap_share=0.5, nccl_sm_share=0.25)
    communication = {("all_to_all", False): Traffic(335e9, 10)}
    staged = predict_step_time(
        _work(communication=communication), _shape(overlapped_stages=4), profile
    )
    whole = 1.0 + 10 * 11e-6
    overlapped = whole / 4  # 0.25 s per stage under 0.5 s of attention: the first stage shows
    exposed = 0.5 * (overlapped + 0.25 * (whole - overlapped)) + 0.5 * whole
    assert staged.time_breakdown_s["exposed head all-to-all"] == pytest.approx(exposed)
    margin = overlapped + 2.0 * 0.25 / 0.75
    assert staged.sm_margin_saves_s == pytest.approx(exposed - margin)
    assert staged.sm_margin_saves_s < 0  # 2 s of attention slowed by a third: it does not pay
    ring = {("p2p", False): Traffic(370e9 * 0.5, 4)}  # 0.5 s of sends under 2 s of attention
    ringed = predict_step_time(_work(communication=ring), _shape(), profile)
    assert ringed.time_breakdown_s["exposed ring p2p"] == pytest.approx(
        0.5 * (0 + 0.25 * 0.5) + 0.5 * 0.5
    )
    fsdp = {("all_gather", False): Traffic(370e9 * 2, 2)}  # 2 s under 3 s of compute
    gathered = predict_step_time(_work(communication=fsdp), _shape(), profile)
    assert gathered.time_breakdown_s["exposed FSDP collectives"] == pytest.approx(1.0 + 0.25 * 2)


def _fields(profile: HardwareProfile) -> list[str]:
    """Every constant of a profile: its numbers and each kernel's three attention rates."""
    numbers = [
        f.name
        for f in dataclass_fields(profile)
        if f.type in ("float", "int") and isinstance(getattr(profile, f.name), float | int)
    ]
    rates = ("forward_causal", "forward_full", "backward")
    return numbers + [
        f"attention.{kernel}.{rate}" for kernel in profile.attention for rate in rates
    ]


@pytest.mark.parametrize("name", sorted(GPU_PROFILES))
def test_every_gpu_constant_has_a_cited_range(name: str) -> None:
    """No constant of a GPU profile lacks a range with a source for each end and what cuts
    against it; the profile's value is the range's central value, between the ends."""
    profile = GPU_PROFILES[name]
    constants = _fields(profile)
    assert set(constants) == set(profile.ranges), "every constant, and only constants, ranged"
    for key in constants:
        span = profile.ranges[key]
        assert span.low_source.strip() and span.high_source.strip() and span.against.strip(), key
        assert 0 <= span.low <= span.high, key
        assert span.kind in ("rate", "cost", "share", "definition"), key
        assert (span.low == span.high) == (span.kind == "definition"), key
        values = [_value(profile.at(end), key) for end in ENDS]
        assert values[1] == pytest.approx(_value(profile, key)), key
        assert min(values[0], values[2]) <= values[1] <= max(values[0], values[2]), key


def _value(profile: HardwareProfile, key: str) -> float:
    if key.startswith("attention."):
        _, kernel, rate = key.split(".")
        return getattr(profile.attention[kernel], rate)
    return getattr(profile, key)


def test_band_prices_the_ends_of_the_ranges() -> None:
    """The band is the step priced at the slow and the fast end of every range; a ratio of two
    steps is taken end by end."""
    work, shape = _work(communication={("all_to_all", False): Traffic(335e9, 10)}), _shape()
    timed = predict_step_time(work, shape, H100_SXM)
    fast, slow = (predict_step_time(work, shape, H100_SXM.at(end)) for end in ("fast", "slow"))
    assert timed.step_time_range_s == pytest.approx((fast.step_time_s, slow.step_time_s))
    assert fast.step_time_s < timed.step_time_s < slow.step_time_s
    doubled = predict_step_time(_work(matmul_flops=2 * 792e12), shape, H100_SXM)
    central, low, high = speedup(timed, doubled)
    assert low <= central <= high and central > 1
    # A measured profile (no ranges) has a point for a band.
    point = predict_step_time(work, shape, UNIT)
    assert point.step_time_range_s == pytest.approx((point.step_time_s,) * 2)


def test_kept_attention_skips_the_recompute_and_costs_its_memory() -> None:
    """keep_attention: the planner's traced step runs each attention forward once instead of
    twice (the checkpoint's recompute takes the kept output), and holds the kept outputs on the
    device ('device') or on the host ('host')."""
    checkpointed = ("--activation_checkpoint.mode", "full")
    plans = {
        where: _debug_plan(*checkpointed, "--activation_checkpoint.keep_attention", where)[1]
        for where in ("none", "device", "host")
    }

    def forward_flops(plan) -> float:
        return sum(
            v for k, v in plan.speed.work.items() if "attention FLOPs" in k and "forward" in k
        )

    recomputed = forward_flops(plans["none"])
    assert forward_flops(plans["device"]) == pytest.approx(recomputed / 2)
    assert forward_flops(plans["host"]) == pytest.approx(recomputed / 2)
    # the first half of the blocks recompute theirs: three quarters of the forward FLOPs remain
    args = model_args(parse_args(["--config", DEBUG]).model, 512)
    _, half = _debug_plan(
        *checkpointed,
        "--activation_checkpoint.keep_attention",
        "device",
        "--activation_checkpoint.keep_attention_skip_first",
        str(args.n_layers // 2),
    )
    assert forward_flops(half) == pytest.approx(recomputed * 3 / 4)
    peaks = [plans["none"], half, plans["device"]]
    assert sorted(peaks, key=lambda plan: plan.device_peak_bytes) == peaks
    assert plans["device"].speed.step_time_s < plans["none"].speed.step_time_s
    # one layer's output (B, S/C, H*d) in bf16, at least, kept through the peak
    config = parse_args(["--config", DEBUG])
    out_bytes = (
        2 * config.training.local_batch_size * 512 // 2 * args.n_heads * (args.dim // args.n_heads)
    )
    assert plans["device"].device_peak_bytes >= plans["none"].device_peak_bytes + out_bytes
    assert plans["host"].host_peak_bytes >= plans["none"].host_peak_bytes + out_bytes
