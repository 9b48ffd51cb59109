"""Hardware profiles for the step-time model: what one GPU (or CPU process) and its links do per
second. Every constant comes from a published hardware or kernel measurement, named beside it;
none is fitted to the throughput the model is checked against (the UPipe paper's Table 3).

The sources are collected in the project's research notes (speed anchors): the NVIDIA H100 and
H200 datasheets, the FlashAttention-3 paper (arXiv 2407.08608, Figs. 5-6: H100 SXM, bf16,
head_dim 128, 16K tokens), stas00/ml-engineering's maximum achievable matmul FLOPs table,
nccl-tests and NCCL issues for NVLink and InfiniBand bandwidths, nvbandwidth for PCIe copies.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

TERA, GIGA, MICRO = 1e12, 1e9, 1e-6


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
    """Throughputs of one rank's device and links (module docstring for the sources)."""

    name: str
    peak_flops: float
    """Dense bf16 peak, FLOP/s: the denominator of MFU."""
    matmul_flops: float
    """Achieved bf16 matmul FLOP/s on large GEMMs."""
    memory_bytes_per_s: float
    """Device memory bandwidth: elementwise and reduction ops are charged their bytes at this."""
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
    """Fixed cost of dispatching one op where nothing hides it. On a GPU 0: eager PyTorch
    launches asynchronously and the host runs ahead of kernels lasting milliseconds at these
    lengths. On CPU the op runs on the dispatching thread, so it is measured."""
    sources: dict[str, str] = field(default_factory=dict)

    def attention_rates(self, kernel: str) -> AttentionRates:
        return self.attention[kernel if kernel in self.attention else "flash"]

    def as_dict(self) -> dict:
        return asdict(self)


_FA3 = AttentionRates(616 * TERA, 648 * TERA, 561 * TERA, "FA3 paper Figs. 5-6 (FA3)")
_CUDNN = AttentionRates(539 * TERA, 595 * TERA, 516 * TERA, "FA3 paper Figs. 5-6 (cuDNN)")
_FA2 = AttentionRates(335 * TERA, 370 * TERA, 322 * TERA, "FA3 paper Figs. 5-6 (FA2)")
_FA4_ON_HOPPER = AttentionRates(
    616 * TERA,
    648 * TERA,
    561 * TERA,
    "no published H100 figure for FA4 (its paper measures B200): planned at FA3's rates",
)

_HOPPER_SOURCES = {
    "peak_flops": "989 TFLOP/s dense bf16: NVIDIA H100 SXM datasheet (torchtitan get_peak_flops)",
    "matmul_flops": "792 TFLOP/s: best achieved bf16 matmul on H100 SXM, stas00/ml-engineering "
    "(compute/accelerator, maximum achievable matmul FLOPS table)",
    "attention": "FA3 paper (arXiv 2407.08608) Figs. 5-6, H100 SXM, bf16, head_dim 128, 16K",
    "all_to_all_bus_bytes_per_s": "335 GB/s busbw, all-to-all on H100 NVLink4, 500 MB messages "
    "(NVIDIA/nccl#2169)",
    "collective_bus_bytes_per_s": "370 GB/s busbw on non-allreduce collectives, 8 x H100 "
    "(NVIDIA/nccl-tests#212)",
    "p2p_bytes_per_s": "370 GB/s: the same NVLink4 busbw (450 GB/s per direction on the wire)",
    "inter_node_bytes_per_s": "47 GB/s: InfiniBand NDR 400G, 46-49 GB/s per NIC "
    "(nccl-tests#267, #290)",
    "collective_latency_s": "11 us: small-message all-to-all on NVLink4 (DeepEP#303; NCCL's "
    "model 3.4 us link + 8.4 us base, nccl#1334)",
    "host_link_bytes_per_s": "26 GB/s: one GPU's pinned copies reach 52-57 GB/s "
    "(nvbandwidth#6, #24); a DGX H100 puts two GPUs behind each PCIe Gen5 x16 switch uplink, "
    "so with all eight copying each gets half of 52 GB/s",
    "host_adamw_params_per_s": "300M params/s per rank: torch's fp32 AdamW, 537M params in "
    "1.81 s on 2 threads (ISEEKYAN/Megatron-LM#188)",
}

H100_SXM = HardwareProfile(
    name="h100-sxm",
    memory_gib=80.0,  # the planner's long-standing default (nvidia-smi: 81559 MiB, 79.65 GiB)
    peak_flops=989 * TERA,
    matmul_flops=792 * TERA,
    memory_bytes_per_s=3350 * GIGA,
    attention={"fa3": _FA3, "fa4": _FA4_ON_HOPPER, "cudnn": _CUDNN, "flash": _FA2, "sdpa": _FA2},
    all_to_all_bus_bytes_per_s=335 * GIGA,
    collective_bus_bytes_per_s=370 * GIGA,
    p2p_bytes_per_s=370 * GIGA,
    inter_node_bytes_per_s=47 * GIGA,
    collective_latency_s=11 * MICRO,
    host_link_bytes_per_s=26 * GIGA,
    host_adamw_params_per_s=300e6,
    sources={
        **_HOPPER_SOURCES,
        "memory_bytes_per_s": "3.35 TB/s HBM3: NVIDIA H100 SXM datasheet",
    },
)

H200 = HardwareProfile(
    **{
        **{key: value for key, value in asdict(H100_SXM).items() if key != "attention"},
        "attention": H100_SXM.attention,
        "name": "h200",
        "memory_gib": 140.0,  # 141 GB: nvidia-smi's 143771 MiB (140.4 GiB), rounded down
        "memory_bytes_per_s": 4800 * GIGA,
        "sources": {
            **_HOPPER_SOURCES,
            "memory_bytes_per_s": "4.8 TB/s HBM3e: NVIDIA H200 SXM datasheet",
            "note": "the same GH100 compute and NVLink4 as H100 SXM (H200 datasheet: 989 "
            "TFLOP/s bf16, 900 GB/s NVLink); only memory size and bandwidth differ",
        },
    }
)

GPU_PROFILES = {profile.name: profile for profile in (H100_SXM, H200)}


def load_profile(path: str | Path) -> HardwareProfile:
    """A profile saved as JSON (``benchmarks/cpu_profile.py`` writes the measured CPU one)."""
    data = json.loads(Path(path).read_text())
    data["attention"] = {name: AttentionRates(**rates) for name, rates in data["attention"].items()}
    return HardwareProfile(**data)
