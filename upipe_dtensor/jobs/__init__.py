"""The jobs: what a command runs from a job config.

``build`` is the one path from a config to a parallelised model on its device (used by every job,
and by the planner on fake tensors); ``parallelize`` applies the CP style, the memory stack,
compile and FSDP2 in a fixed order; ``trainer`` is the training loop behind ``train.py``;
``evaluate`` and ``convert`` are the bodies of ``python -m upipe_dtensor.evaluate`` / ``.convert``.
"""
