"""Run-time helpers every job shares; the bottom layer above ``upipe_dtensor.errors``.

``errors`` holds the one ladder from outcome to exit code (``run_main``; the exceptions live in
``upipe_dtensor.errors``); ``shutdown`` turns SIGTERM/SIGUSR1/Ctrl-C and a dead launcher into a
clean stop, with ``rank_deaths`` naming a rank that died; ``collectives`` holds the small rank-0 /
every-rank agreements; ``process_group`` the backend string every job initialises; ``logs``
sets up every command's log output (rank-aware, one format); ``metrics`` logs the step line and
hands the scalars to its sinks (tensorboard, JSONL, Weights & Biases), with MFU from
``peak_flops``, the one table of GPU peaks; ``host_store`` is the one device-runtime seam
(streams, events, pinned host memory); ``fake_process_group`` lays a job's ranks out in one
process for the planner; ``parity`` compares a context-parallel model with the
unsharded one (the tests and ``gpu_check``).
"""
