"""Per-layer communication volume of each CP method at full scale, as a markdown table.

The numbers come from ``upipe_dtensor.planning.communication_volume.layer_traffic``, whose formulas
tests/test_communication.py checks byte for byte against the sends counted on real gloo runs. They
are what one rank sends for one attention layer (bf16 activations), split into the head axis
(all-to-all, inside a node) and the ring axis (point-to-point; across nodes in 2D), for one training
step under full activation checkpointing (forward twice, backward once).

    python benchmarks/communication_volume.py
"""

from __future__ import annotations

from upipe_dtensor.planning.communication_volume import layer_traffic

GiB = 2**30
MODELS = {
    "Llama3-8B": dict(n_heads=32, n_kv_heads=8, head_dim=128),
    "32B shape": dict(n_heads=64, n_kv_heads=8, head_dim=128),
}
# (model, method label, style, seq_len, cp, ring degree, heads per stage U)
ROWS = [
    ("Llama3-8B", "UPipe (U = 8)", "upipe", 5 * 2**20, 8, 1, 8),
    ("Llama3-8B", "Ulysses", "ulysses", 5 * 2**20, 8, 1, 32),
    ("Llama3-8B", "ring", "ring", 5 * 2**20, 8, 1, 32),
    ("Llama3-8B", "FPDT", "fpdt", 5 * 2**20, 8, 1, 32),
    ("Llama3-8B", "UPipe-2D (2 x 8, U = 8)", "upipe", 12 * 2**20, 16, 2, 8),
    ("Llama3-8B", "Ulysses-2D (2 x 8)", "ulysses", 12 * 2**20, 16, 2, 32),
    ("Llama3-8B", "UPipe 16-way (KV replicated, U = 16)", "upipe", 12 * 2**20, 16, 1, 16),
    ("32B shape", "UPipe (U = 16, KV replicated)", "upipe", 4 * 2**20, 16, 1, 16),
    ("32B shape", "Ulysses", "ulysses", 4 * 2**20, 16, 1, 64),
    ("32B shape", "ring", "ring", 4 * 2**20, 16, 1, 64),
    ("32B shape", "FPDT", "fpdt", 4 * 2**20, 16, 1, 64),
    ("32B shape", "UPipe-2D (2 x 8, U = 8)", "upipe", 8 * 2**20, 16, 2, 8),
    ("32B shape", "Ulysses-2D (2 x 8)", "ulysses", 8 * 2**20, 16, 2, 64),
]


def main() -> None:
    print(
        "| model | method | tokens | GPUs | all-to-all, GiB | ring, GiB | what crosses nodes (8 "
        "GPUs each) |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    for model, label, style, seq_len, cp, ring, u in ROWS:
        traffic = layer_traffic(
            style,
            seq_len=seq_len,
            batch=1,
            cp=cp,
            ring_degree=ring,
            heads_per_stage=u,
            dtype_bytes=2,
            **MODELS[model],
        )
        all_to_all, ring_bytes = traffic.per_step()
        print(
            f"| {model} | {label} | {seq_len / 2**20:.0f}M | {cp} | {all_to_all / GiB:.2f} | "
            f"{ring_bytes / GiB:.2f} | {_across_nodes(style, cp, ring)} |"
        )


def _across_nodes(style: str, cp: int, ring: int) -> str:
    """Which of a rank's bytes leave its node, with 8 GPUs per node and the head axis inside one."""
    if cp <= 8:
        return "nothing"
    if ring > 1:
        return "all ring bytes (each ring joins ranks of different nodes)"
    if style == "ring":
        return f"ring bytes of {cp // 8} of the {cp} hops per step"
    return f"{cp - 8}/{cp - 1} of the all-to-all bytes (to peers in the other node)"


if __name__ == "__main__":
    main()
