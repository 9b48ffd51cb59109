"""The jobs: what a command runs from a job config. Two layers (``tests/test_layering.py``):

The assembly, which the planner rehearses on fake ranks and so sits below ``planning``: ``setup``
holds what a job has before its model (placement, meshes, the checked job); ``build`` is the one
path from a config to a parallelised model on its device (used by every job, and by the planner
on fake tensors); ``parallelize`` applies the CP style, the memory stack, compile and FSDP2 in a
fixed order; ``trainer`` is the training loop behind ``train.py``, which calls ``preflight`` (its
checks before the model), ``resume`` (the snapshot to resume from, the checkpointer),
``optimizer`` (AdamW, the LR schedule) and ``export`` (the Hugging Face folder at the end).

The commands, above ``planning``: ``evaluate`` (loss by position) and ``retrieval`` (its
``--task``), sharing ``eval_common``; ``convert``; ``gpu_check``, which prints the planner's
prediction beside the measured step. They are the bodies of ``python -m upipe_dtensor.evaluate``,
``.convert`` and ``.gpu_check``.
"""
