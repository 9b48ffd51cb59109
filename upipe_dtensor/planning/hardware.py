"""Hardware profiles for the step-time model: what one GPU (or CPU process) and its links do per
second, each constant as a range between two cited sources.

Every constant of a GPU profile is a ``Range``: a low and a high value, each with its source, what
the sources (or others) say that cuts against it, and, where the value is not a figure printed by
its source, how it was derived. None was set from the throughput the model is checked against
(the UPipe paper's Table 3); each range was chosen by the rule in its docstring below before the
paper table was priced with it. Prices use three ends of every range:

- ``slow``: every rate at its low value and every cost (latency, per-op overhead, NCCL's share of
  the SMs) at its high value, every overlap at its worst; ``fast``: the other way round. A step
  priced at both ends is the band a prediction carries: an outer band, since it aligns every
  error in one direction;
- ``central`` (the profile's own values): the value at which a unit of the constant's work costs
  the midpoint of its two ends' prices: the harmonic mean of a rate's ends (time goes as
  1/rate), the arithmetic mean of a cost's or a share's (time goes linearly with it). A rule, the
  same for every constant, not a choice per constant.

Derived, not printed by a source as is (each ``Range.derived`` says how): the matmul low (the
FLOP-weighted mean of four published shapes), the H100 HBM low and the H200 HBM high (fractions of
peak carried from one GPU to the other), the attention highs (a published figure scaled to the
boost clock, causal at the non-causal rate), FA4 (FA3's ranges: no Hopper figure is published),
the all-to-all low (a published 15% drop applied), point-to-point (from the collective figures),
the host link low (one GPU's figure halved), NCCL's share of the SMs (channels over SMs) and the
overlap share (the two outcomes of a race). Sources are named as owner/repo#issue (GitHub),
arXiv ids, or datasheets; ``shared/research/speed-anchors.md`` collects the older ones.

One disclosure: a high end for the attention rates was looked for because an audit of the
previous model (``shared/research/reviews/step-time-model-audit.md``) found the FA3 paper's 16K
figures too slow to produce the paper's million-token cells; the value found comes from the FA3
paper and the H100 datasheet by the rule above, not from that table.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from upipe_dtensor.runtime.peak_flops import PEAK_BF16_FLOPS

TERA, GIGA, MICRO = 1e12, 1e9, 1e-6
ENDS = ("slow", "central", "fast")


@dataclass(frozen=True)
class Range:
    """A constant's span between two cited values (module docstring)."""

    low: float
    high: float
    low_source: str
    high_source: str
    against: str
    """What the sources, or others, say that cuts against the range."""
    derived: str = ""
    """How the range comes from its sources where a value is not printed by them as is."""
    kind: str = "rate"
    """"rate" (time goes as 1/value: the slow end is ``low``), "cost" (time goes with the value:
    the slow end is ``high``), "share" (time falls linearly as the value rises: the slow end is
    ``low``) or "definition" (a datasheet figure that prices no time: low == high)."""

    def value(self, end: str) -> float:
        """The constant at one end of the range ("slow", "central", "fast")."""
        if end == "central":
            if self.kind == "rate":
                return 2 / (1 / self.low + 1 / self.high)
            return (self.low + self.high) / 2
        slow = self.high if self.kind == "cost" else self.low
        fast = self.low if self.kind == "cost" else self.high
        return {"slow": slow, "fast": fast}[end]


@dataclass(frozen=True)
class AttentionRates:
    """One attention kernel's throughput, FLOP/s, counted as the FlashAttention papers count:
    forward 4 x visible (query, key) pairs x heads x head_dim, backward 2.5 x that."""

    forward_causal: float
    forward_full: float
    backward: float
    source: str


@dataclass(frozen=True)
class HardwareProfile:
    """Throughputs of one rank's device and links. The numbers are the central values; a GPU
    profile's ``ranges`` hold every constant's range and sources (module docstring)."""

    name: str
    peak_flops: float
    """Dense bf16 peak, FLOP/s: the denominator of MFU."""
    matmul_flops: float
    """Achieved bf16 matmul FLOP/s on the step's GEMMs."""
    memory_bytes_per_s: float
    """Achieved device memory bandwidth of eager elementwise, reduction and copy kernels."""
    attention: dict[str, AttentionRates]
    """Per kernel: "fa3", "fa4", "cudnn", "flash" (FlashAttention-2, also aten's "sdpa"), "cpu"."""
    all_to_all_bus_bytes_per_s: float
    """All-to-all bus bandwidth inside a node (nccl-tests' busbw = algbw x (n-1)/n)."""
    collective_bus_bytes_per_s: float
    """All-gather / reduce-scatter bus bandwidth inside a node."""
    p2p_bytes_per_s: float
    """Point-to-point (ring) bandwidth per direction inside a node."""
    inter_node_bytes_per_s: float
    """Per GPU across nodes (one NIC per GPU): every collective or p2p whose group spans nodes."""
    collective_latency_s: float
    """Fixed cost of one collective call."""
    host_link_bytes_per_s: float
    """Host <-> device copies per GPU when all GPUs of a node copy at once."""
    host_adamw_params_per_s: float
    """AdamW steps per second of one rank's host share (FSDP CPU offload)."""
    memory_gib: float = 0.0
    """Memory per GPU, GiB: the planner's default budget for this kind (0: none, e.g. a CPU)."""
    op_overhead_s: float = 0.0
    """Fixed cost per op where nothing hides it: on a GPU the gap between back-to-back kernels;
    on CPU the op runs on the dispatching thread, so it is measured."""
    overlap_share: float = 1.0
    """Of the exchanges posted to overlap an attention kernel, the share that gets SMs while it
    runs (the rest waits for the kernel to end). 1 on CPU: gloo's threads need no SMs."""
    nccl_sm_share: float = 0.0
    """The share of the SMs an intra-node NCCL kernel holds while it overlaps compute (NCCL CTAs
    do not share an SM): the compute it overlaps slows by this share of its duration."""
    ranges: dict[str, Range] = field(default_factory=dict)
    """Field name (attention: "attention.<kernel>.<rate>") -> its range; empty for a measured
    profile (the CPU's), whose band is a point."""
    sources: dict[str, str] = field(default_factory=dict)

    def attention_rates(self, kernel: str) -> AttentionRates:
        return self.attention[kernel if kernel in self.attention else "flash"]

    def at(self, end: str) -> HardwareProfile:
        """This profile with every ranged constant at one end ("slow", "central", "fast")."""
        if end not in ENDS:
            raise ValueError(f"end {end!r}: one of {', '.join(ENDS)}")
        plain = {k: r.value(end) for k, r in self.ranges.items() if not k.startswith("attention.")}
        attention = {}
        for kernel, rates in self.attention.items():
            ends = {
                rate: self.ranges[f"attention.{kernel}.{rate}"].value(end)
                for rate in ("forward_causal", "forward_full", "backward")
                if f"attention.{kernel}.{rate}" in self.ranges
            }
            attention[kernel] = replace(rates, **ends)
        return replace(self, attention=attention, **plain)

    def as_dict(self) -> dict:
        return asdict(self)


def _profile(name: str, ranges: dict[str, Range]) -> HardwareProfile:
    """A GPU profile whose constants are the central values of ``ranges``."""
    central = {k: r.value("central") for k, r in ranges.items() if not k.startswith("attention.")}
    kernels = {key.split(".")[1] for key in ranges if key.startswith("attention.")}
    attention = {
        kernel: AttentionRates(
            *(
                ranges[f"attention.{kernel}.{rate}"].value("central")
                for rate in ("forward_causal", "forward_full", "backward")
            ),
            source=ranges[f"attention.{kernel}.forward_causal"].low_source,
        )
        for kernel in sorted(kernels)
    }
    return HardwareProfile(name=name, attention=attention, ranges=dict(ranges), **central)


# --- sources -------------------------------------------------------------------------------------
_FA3_PAPER = "FA3 paper (arXiv 2407.08608) Figs. 5-6, H100 SXM, bf16, head_dim 128, 16K tokens"
_BOOST = (
    "at million-token heads the causal diagonal (1 tile of S/128 per row) no longer costs, so "
    "causal runs at the non-causal rate, and the GPU may boost to its 1980 MHz maximum (H100 SXM "
    "datasheet) where the FA3 paper fixed 1830 MHz (its App. C.1): the paper's non-causal "
    "figure x 1980/1830"
)
_NO_LONG = "no published figure above 16K tokens per head was found"


def _attention_ranges(
    kernel: str, low: tuple[float, float, float], low_sources: tuple[str, str, str], against: str
) -> dict[str, Range]:
    """Forward causal, forward full and backward: ``low`` as published; high by ``_BOOST`` from
    the paper's non-causal forward figure (``low[1]`` when that is the paper's) and backward."""
    full, backward = low[1], low[2]
    highs = (full * 1980 / 1830, full * 1980 / 1830, backward * 1980 / 1830)
    names = ("forward_causal", "forward_full", "backward")
    return {
        f"attention.{kernel}.{name}": Range(
            value * TERA,
            high * TERA,
            source,
            f"{high:.0f} TFLOP/s: the {_FA3_PAPER} figure x 1980/1830",
            against,
            derived=f"high: {_BOOST}",
        )
        for name, value, high, source in zip(names, low, highs, low_sources)
    }


_FA3 = {
    **_attention_ranges(
        "fa3",
        (616, 648, 561),
        (
            f"616 TFLOP/s causal forward: {_FA3_PAPER}",
            f"648 TFLOP/s: {_FA3_PAPER}",
            f"561 TFLOP/s: {_FA3_PAPER} (the panel's causal flag is not visible; tritonbench#1256 "
            "measured FA3's non-causal backward at 8K at 561.4)",
        ),
        f"tritonbench#1267 (2026) timed FA3's causal forward at 8K at 685 TFLOP/s (FA counting), "
        f"above the paper's 616; pytorch/benchmark#2391 measured the non-causal forward at 16K at "
        f"620.7, tritonbench#1254 at 8K at 638.6, below the paper's 648; tritonbench#1267's causal "
        f"backward at 8K is 539; a power-limited H100 measured 465 at 8K (tritonbench#141); "
        f"{_NO_LONG}",
    ),
}
# the lowest published forward-full and backward figures at >= 8K tokens
_FA3["attention.fa3.forward_full"] = replace(
    _FA3["attention.fa3.forward_full"],
    low=620.7 * TERA,
    low_source="620.7 TFLOP/s: FA3 non-causal forward, (1, 16, 16384, 128), H100 "
    "(pytorch/benchmark#2391)",
)
_FA3["attention.fa3.backward"] = replace(
    _FA3["attention.fa3.backward"],
    low=539 * TERA,
    low_source="539 TFLOP/s: FA3 causal backward, B=4 H=48 S=8192 d=128 in 15.31 ms, H100 BF16 "
    "(tritonbench#1267; FA counting: 2.5 x 4 x B x H x d x S^2/2)",
)
_CUDNN = _attention_ranges(
    "cudnn",
    (539, 595, 516),
    tuple(f"{v} TFLOP/s (cuDNN 9.1): {_FA3_PAPER}" for v in (539, 595, 516)),
    f"cuDNN releases after 9.1 are faster; {_NO_LONG}",
)
_FA2_AGAINST = (
    f"at 32K on H100 FA2 measured 355 forward, 337 backward (flash-attention#1051); {_NO_LONG}"
)
_FA2 = {
    **_attention_ranges(
        "flash",
        (335, 370, 322),
        tuple(f"{v} TFLOP/s (FlashAttention-2): {_FA3_PAPER}" for v in (335, 370, 322)),
        _FA2_AGAINST,
    ),
}
_SDPA = {key.replace(".flash.", ".sdpa."): value for key, value in _FA2.items()}
_FA4 = {
    key.replace(".fa3.", ".fa4."): replace(
        value,
        against="no published H100 figure for FA4 (its paper measures B200): FA3's range, an "
        "assumption",
        derived=value.derived + "; FA4 on Hopper planned at FA3's range",
    )
    for key, value in _FA3.items()
}

_MAMF = (
    "794.5 TFLOP/s: best of a brute-force matmul shape search, H100 SXM, torch 2.7 cu126, "
    "2048x2048x13312 (stas00/ml-engineering, compute/accelerator, MAMF table, 2026 snapshot)"
)

_H100_SXM_NAME = "NVIDIA H100 80GB HBM3"
"""The H100 SXM as ``torch.cuda.get_device_name`` names it (H200 has the same compute)."""

_HOPPER: dict[str, Range] = {
    "peak_flops": Range(
        PEAK_BF16_FLOPS[_H100_SXM_NAME],
        PEAK_BF16_FLOPS[_H100_SXM_NAME],
        "989 TFLOP/s dense bf16: NVIDIA H100 SXM datasheet (528 tensor cores x 1024 FLOP per "
        "clock x 1.83 GHz; torchtitan get_peak_flops), the package's one peak table "
        "(runtime.peak_flops), which the step log's MFU reads too",
        "the same datasheet figure",
        "computed at the 1980 MHz maximum clock it is 1070 (pytorch/pytorch#172523 prints "
        "1070.5 for H100); prices no work: only MFU's denominator",
        kind="definition",
    ),
    "matmul_flops": Range(
        560 * TERA,
        794.5 * TERA,
        "560 TFLOP/s: bf16 times of Llama-2-70B's four training GEMMs at 16384 tokens on one H100 "
        "(meta-pytorch/float8_experimental#38, 2023: wqkv 16384x8192x1280 569, wo 550, w13 539, "
        "w2 605 TFLOP/s)",
        _MAMF,
        "MAMF's own page: the best shape does not transfer ('chances are low that you will ever "
        "hit that exact shape'); the 2023 low predates two years of cuBLAS; square 4096-8192 "
        "GEMMs reached 789-798 and 10240 720 on torch 2.7 "
        "(zzc0721/torch-performance-test-data#79); a step's GEMMs all have every dimension >= "
        "1024 (4096-token MLP tiles, per-stage Q/K/V projections of 1024 columns, 2048-token loss "
        "chunks): the large-GEMM class both sources measured, so the range is not split by shape",
        derived="low: the FLOP-weighted mean of the four shapes' figures (their times summed)",
    ),
    "memory_bytes_per_s": Range(
        2350 * GIGA,
        2770 * GIGA,
        "2.35 TB/s: 70% of the 3.35 TB/s peak, the share eager PyTorch's binary elementwise "
        "'maximum' reached on H200 at (1024, 20480) fp16 (3.37 of 4.8 TB/s, tile-ai/TileOPs#512)",
        "2.77 TB/s: the best gather kernel measured on H100 SXM5 700W (pytorch/FBGEMM#3993; its "
        "scatter_add 2.54)",
        "the 3.35 TB/s datasheet peak is not reached; smaller tensors get less (TileOPs#512: 1.83 "
        "TB/s at 8 MB on H200); strided copies through TensorIterator (the permutes around "
        "all-to-alls) ran at 17-30% of peak on GH200 (pytorch/pytorch#194310)",
        derived="low: a fraction of peak measured on H200 applied to H100's peak",
    ),
    **_FA3,
    **_FA4,
    **_CUDNN,
    **_FA2,
    **_SDPA,
    "all_to_all_bus_bytes_per_s": Range(
        285 * GIGA,
        370 * GIGA,
        "285 GB/s: all-to-all busbw 335 GB/s at 500 MB on 4 H100s, less the 15% the same issue "
        "reports above 512 MB (NVIDIA/nccl#2169)",
        "370 GB/s: NCCL's effective NVLink4 busbw on non-allreduce collectives "
        "(NVIDIA/nccl-tests#212, sjeaugey)",
        "no 8-GPU all-to-all by message size was found: the step's calls carry 29 MB (128K) to "
        "1.2 GB (5M) and busbw falls with size below ~256 MB (nccl-tests#212); another run in "
        "nccl#2169 with other flags measured 120.8 GB/s",
        derived="low: a published drop applied to a published figure",
    ),
    "collective_bus_bytes_per_s": Range(
        335 * GIGA,
        370 * GIGA,
        "335 GB/s: the lowest NVLink4 busbw found at FSDP's message sizes (~400 MB per block): "
        "all-to-all at 500 MB (NVIDIA/nccl#2169)",
        "370 GB/s: NCCL's effective NVLink4 busbw on non-allreduce collectives "
        "(NVIDIA/nccl-tests#212)",
        "no 8-GPU all-gather / reduce-scatter figure at these sizes was found",
    ),
    "p2p_bytes_per_s": Range(
        335 * GIGA,
        370 * GIGA,
        "335 GB/s: as the collectives (NCCL's all-to-all is grouped send/recv: nccl#2169)",
        "370 GB/s: as the collectives (nccl-tests#212)",
        "copy engines reached 376-380 GB/s one way (cuda-samples p2pBandwidthLatencyTest on HGX "
        "H100, NVIDIA/nccl#1264); NCCL's SM copies carry 128-byte payloads where copy engines "
        "carry 256 (nccl-tests#149)",
        derived="no send/recv figure: the collective range",
    ),
    "inter_node_bytes_per_s": Range(
        46 * GIGA,
        49 * GIGA,
        "46 GB/s: InfiniBand NDR 400G, 46-48 GB/s per NIC (NVIDIA/nccl-tests#290)",
        "49 GB/s: 'up to 48-49 GB/s per NIC' (NVIDIA/nccl-tests#267)",
        "all-to-all cannot aggregate several NICs (nccl-tests#267); RoCE fabrics vary",
    ),
    "collective_latency_s": Range(
        10.5 * MICRO,
        11.8 * MICRO,
        "10.5 us: small-message (128 B-4 KB) all-to-all on NVLink4 H20s (deepseek-ai/DeepEP#303)",
        "11.8 us: NCCL's tuning model for NVLink, Ring/Simple: 3.4 us link + 8.4 us base "
        "(NVIDIA/nccl#1334)",
        "measured on H20 (the same NVLink4), not H100; negligible at these message sizes",
        kind="cost",
    ),
    "host_link_bytes_per_s": Range(
        26 * GIGA,
        52.8 * GIGA,
        "26 GB/s: half of one GPU's 52.8 GB/s: four GPUs of an 8-GPU HGX H100 share each "
        "socket's root complex and memory, and copies run both ways at once (on 8 x A100 H2D "
        "fell to 44% of its one-way rate with D2H running, NVIDIA/nvbandwidth#53)",
        "52.8 GB/s: one H100 copying alone, D2H (NVIDIA/nvbandwidth#24; copy engines 52-57, #6)",
        "no figure for 8 H100s copying at once was found (shared/research/speed-anchors.md); "
        "DGX-2 fell from 12 to 3 GB/s per GPU with all copying (deepspeedai/DeepSpeed#1137); SM "
        "H2D copies measured 35.2 GB/s (nvbandwidth#24); pageable memory is slower still",
        derived="low: one GPU's figure halved",
    ),
    "host_adamw_params_per_s": Range(
        31e6,
        297e6,
        "31M params/s per rank: torch fp32 AdamW, 536.9M params in 17.2 s with 8 concurrent "
        "ranks on ~2 exposed cores (ISEEKYAN/Megatron-LM#188)",
        "297M params/s: the same, 1 rank on 2 threads, 1.81 s (ISEEKYAN/Megatron-LM#188)",
        "the 8-rank figure is a starved host (a slurm step exposing 2 CPUs); a full DGX gives 8 "
        "ranks 14 cores each, and DeepSpeed's CPU-Adam reports ~1.4B params/s "
        "(deepspeedai/DeepSpeed#735)",
    ),
    "op_overhead_s": Range(
        0.58 * MICRO,
        2.65 * MICRO,
        "0.58 us per kernel: a replayed CUDA graph of no-op kernels, per node (ahrefs/ocannl#488, "
        "RTX 5070 Ti, CUDA 13.3): the device's floor between kernels",
        "2.65 us per kernel: the same probe's asynchronous enqueue per launch, the pace at which "
        "a host feeds back-to-back kernels (ahrefs/ocannl#488)",
        "measured on a laptop GPU under WSL2, not an H100; eager PyTorch's host dispatch (~10 us "
        "per op) stays hidden while kernels last longer (the 8B 128K step's ops average ~250 us)",
        kind="cost",
    ),
    "overlap_share": Range(
        0.0,
        1.0,
        "0: every overlapped exchange waits for the attention kernel to end: 'the next "
        "communication kernel will be delayed until the gemm is completed because there are not "
        "enough SM resources' (NVIDIA/nccl#1431); without CUDA_DEVICE_MAX_CONNECTIONS=1 a "
        "communication kernel 'will be pushed to the end' of a persistent kernel "
        "(NVIDIA-NeMo/Speech#12875, NVIDIA/Megatron-LM#533), and FA3's forward is persistent "
        "on SM90 (UsePersistentScheduler, hopper/flash_fwd_launch_template.h): its grid is "
        "num_sm = SMs - sm_margin (Dao-AILab/flash-attention hopper/flash_api.cpp, "
        "tile_scheduler.hpp)",
        "1: every exchange posted before its attention kernel (parallel/staged_attention.py "
        "posts stage s+1's before stage s's attention) gets its SMs first and keeps them: NCCL "
        "CTAs do not share an SM (NVIDIA/nccl#689)",
        "this repository leaves CUDA_DEVICE_MAX_CONNECTIONS unset, so which kernel reaches the "
        "SMs first is a race it does not control; FA3's backward launches one CTA per tile, so "
        "exchanges posted during it get SMs as tiles retire: the low end is pessimistic there",
        derived="the two outcomes of the race",
        kind="share",
    ),
    "nccl_sm_share": Range(
        16 / 132,
        32 / 132,
        "16 of 132 SMs: 'on DGX with 8 NICs ... it would use 16 SMs' (NVIDIA/nccl#689)",
        "32 of 132 SMs: an intra-node all-to-all on 8 x H100 creates 32 channels "
        "(NVIDIA/nccl#1685); NCCL runs one CTA per channel it uses",
        "fewer channels for small messages (NVIDIA/nccl#1216); NCCL kernels also take HBM "
        "bandwidth, not priced (NVIDIA/nccl#1433)",
        derived="channels over H100 SXM's 132 SMs (datasheet)",
        kind="cost",
    ),
}


def _memory_gib(gib: float, source: str) -> Range:
    return Range(
        gib,
        gib,
        source,
        source,
        "a budget, not a speed: what the planner fits a plan into by default (--device-memory-gib)",
        kind="definition",
    )


H100_SXM = _profile(
    "h100-sxm",
    {
        **_HOPPER,
        "memory_gib": _memory_gib(
            80.0, "80 GiB: the planner's long-standing default (nvidia-smi: 81559 MiB, 79.65 GiB)"
        ),
    },
)

H200 = _profile(
    "h200",
    {
        **_HOPPER,
        "memory_bytes_per_s": Range(
            3370 * GIGA,
            3980 * GIGA,
            "3.37 TB/s: eager PyTorch's 'maximum' at (1024, 20480) fp16 on H200 "
            "(tile-ai/TileOPs#512)",
            "3.98 TB/s: 83% of the 4.8 TB/s peak, the share of the best gather kernel on H100 "
            "(pytorch/FBGEMM#3993)",
            "the 4.8 TB/s datasheet peak is not reached; the same compute and NVLink4 as H100 "
            "SXM (H200 datasheet: 989 TFLOP/s bf16, 900 GB/s NVLink)",
            derived="high: a fraction of peak measured on H100 applied to H200's peak",
        ),
        "memory_gib": _memory_gib(
            140.0, "140 GiB: 141 GB, nvidia-smi's 143771 MiB (140.4 GiB), rounded down"
        ),
    },
)

GPU_PROFILES = {profile.name: profile for profile in (H100_SXM, H200)}


def load_profile(path: str | Path) -> HardwareProfile:
    """A profile saved as JSON (``benchmarks/cpu_profile.py`` writes the measured CPU one)."""
    data = json.loads(Path(path).read_text())
    data["attention"] = {name: AttentionRates(**rates) for name, rates in data["attention"].items()}
    data["ranges"] = {name: Range(**r) for name, r in data.get("ranges", {}).items()}
    return HardwareProfile(**data)
