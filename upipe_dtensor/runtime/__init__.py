"""Run-time helpers every job shares.

``errors`` holds the outcomes a command reports in one line and the one ladder from outcome to
exit code (``run_main``); ``shutdown`` turns SIGTERM/SIGUSR1/Ctrl-C and a dead launcher into a
clean stop; ``collectives`` holds the small rank-0 / every-rank agreements; ``process_group``
the backend string every job initialises; ``metrics`` logs the step line and tensorboard
scalars.
"""
