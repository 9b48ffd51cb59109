"""The planner: will a job fit, and what is the longest context that does?

``step`` runs the job's real training step (build, forward, backward, optimizer) on fake tensors
and measures its memory with the live-memory ``tracker``; ``max_context`` searches the settings
for the longest context that fits, with the sequence-length search of ``length_search``;
``floor`` refuses in seconds a budget below what any step needs; ``communication_volume`` gives
each method's per-layer bytes; ``cli`` is
``python -m upipe_dtensor.plan``.
"""
