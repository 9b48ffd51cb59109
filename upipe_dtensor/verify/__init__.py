"""The GPU verification tools, above ``planning`` (``tests/test_layering.py``): they measure a
real run beside what the planner predicts.

``gpu_check`` is a user's first GPU run (every style against the unsharded model, one step of the
8B shape beside its plan), the body of ``python -m upipe_dtensor.gpu_check``; ``stand_in`` runs
one device as rank 0 of a recipe's world and measures it against its plan; ``kernel_rates`` times
a step's kernels alone against the ranges of the step-time model; ``evidence`` drives
``scripts/gpu_evidence.sh`` (its parts, their limits, the report).
"""
