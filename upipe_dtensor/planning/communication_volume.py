"""Per-layer communication volume of each CP style, as this repository implements it.

Bytes **each rank sends** for one attention layer, split by axis: the head axis (all-to-all,
inside a node) and the ring axis (point-to-point; across nodes in 2D CP, inside the node for
``ring`` on one node). Derived from the same head schedule the ops run, and checked byte for byte
against counted sends on real gloo runs (tests/test_communication.py).

With n = B*S/C local tokens, d head_dim, b bytes per activation element, C_h the head axis, R the
ring, H_kv' = max(H_kv, C_h) KV heads after replication, P stages of U heads, k KV heads per rank:
  all-to-all, forward : (2*n*H*d + 2*n*H_kv'*d) * b * (C_h - 1) / C_h   (Q and output; K, V)
  all-to-all, backward: twice that (Q, output, dO, dQ; K, V, dK, dV: backward recomputes Q/K/V
                        from x instead of saving them, the UPipe paper's ~33% extra traffic)
  ring, forward       : P * (R - 1) * 2*(n*C_h)*k*d * b        (K, V pass R - 1 hops per stage)
  ring, backward      : P * ((R - 1) * 2*(n*C_h)*k*d * b + R * 2*(n*C_h)*k*d * 4)  (K, V and
                        float32 dK, dV accumulators travelling back to their owner)
FPDT moves the same all-to-all bytes as Ulysses, chunk by chunk (its host traffic is PCIe, not
counted here). Ring attention (C_h = 1, R = C) has no all-to-all. Under full activation
checkpointing a step runs each layer's forward twice (forward, recompute) and its backward once.
"""

from __future__ import annotations

from dataclasses import dataclass

from upipe_dtensor.parallel.head_schedule import make_head_schedule
from upipe_dtensor.parallel.registry import style_spec


@dataclass(frozen=True)
class LayerTraffic:
    """Bytes one rank sends for one layer, per pass and axis."""

    forward_all_to_all: int
    backward_all_to_all: int
    forward_ring: int
    backward_ring: int

    def per_step(self, recompute: bool = True) -> tuple[int, int]:
        """(all-to-all, ring) bytes of one training step for this layer (forward twice when the
        block is recomputed under full activation checkpointing)."""
        passes = 2 if recompute else 1
        return (
            passes * self.forward_all_to_all + self.backward_all_to_all,
            passes * self.forward_ring + self.backward_ring,
        )


def layer_traffic(
    cp_style: str,
    *,
    seq_len: int,
    batch: int,
    cp: int,
    ring_degree: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    heads_per_stage: int,
    dtype_bytes: int,
) -> LayerTraffic:
    """The volume of ``cp_style`` (a registered name: "upipe", "ulysses", "ring", "fpdt") for one
    layer.

    ``ring_degree`` is R for 2D upipe/ulysses (1 otherwise); ``heads_per_stage`` is U as the style
    runs it (``planner`` resolves the config's 0 to the style's default).
    """
    head_axis = style_spec(cp_style).options.head_axis
    heads, ring = (cp // ring_degree, ring_degree) if head_axis else (1, cp)
    schedule = make_head_schedule(n_heads, n_kv_heads, heads, heads_per_stage)
    local = batch * seq_len // cp
    kv_effective = schedule.n_kv_blocks * schedule.kv_heads_per_rank * heads
    forward = 2 * local * head_dim * (n_heads + kv_effective) * dtype_bytes * (heads - 1) // heads
    ring_tokens = local * heads  # tokens of a ring rank, after the head all-to-all
    kv_block = 2 * ring_tokens * schedule.kv_heads_per_rank * head_dim
    stages = len(schedule.stages)
    return LayerTraffic(
        forward_all_to_all=forward,
        backward_all_to_all=2 * forward,
        forward_ring=stages * (ring - 1) * kv_block * dtype_bytes if ring > 1 else 0,
        backward_ring=stages * ((ring - 1) * kv_block * dtype_bytes + ring * kv_block * 4)
        if ring > 1
        else 0,
    )
