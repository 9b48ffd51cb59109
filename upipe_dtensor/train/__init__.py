"""The training job: what ``train.py`` runs from a job config, and what the planner rehearses on
fake ranks, so this package sits below ``planning`` (``tests/test_layering.py``).

``setup`` holds what a job has before its model (placement, meshes, the checked job); ``build``
is the one path from a config to a parallelised model on its device (used by every job, the
commands' and the planner's on fake tensors); ``parallelize`` applies the CP style, the memory
stack, compile and FSDP2 in a fixed order; ``trainer`` is the training loop behind ``train.py``,
which calls ``preflight`` (its checks before the model), ``resume`` (the snapshot to resume from,
the checkpointer), ``optimizer`` (AdamW, the LR schedule) and ``export`` (the Hugging Face folder
at the end).

The user commands that build on it are in ``upipe_dtensor.commands``; the GPU verification tools
in ``upipe_dtensor.verify``; both sit above the planner.
"""
