"""Local compute kernels under one contract: attention returning (out, lse) on every backend
(``attention``, with document boundaries from ``document_blocks``), the exact log-sum-exp merge
of partial results (``merge``), RoPE at millions of positions (``rope``), the tiling helper
(``tiling``), and the switch that runs the project's custom ops opaquely (training) or
transparently (planning) (``op_mode``). ``backends`` chooses the attention backend, after a
``probe`` of it, and ``flash_registry`` points aten's flash ops at FA3/FA4; ``fused`` compiles the
tiled ops' elementwise chains and ``inductor`` registers the custom ops with inductor."""
