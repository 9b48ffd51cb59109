"""Local compute kernels under one contract: attention returning (out, lse) on every backend, the
exact log-sum-exp merge of partial results, RoPE at millions of positions, the tiling helper, and
the switch that runs the project's custom ops opaquely (training) or transparently (planning)."""
