"""The planner: will a job fit, and what is the longest context that does?

``step`` runs the job's real training step (build, forward, backward, optimizer) on fake tensors
and measures its memory with the live-memory ``tracker``; ``max_context`` searches the settings
for the longest context that fits, with the sequence-length search of ``length_search``;
``floor`` refuses in seconds a budget below what any step needs; ``communication_volume`` gives
each method's per-layer bytes. The step time: ``step_work`` counts the traced step's work,
``hardware`` holds the GPU profiles that price it, ``step_time`` predicts the step from both, and
``checkpoint_interval`` how often to save. ``compiled`` replays inductor's graphs on the fake
step; ``rehearsal`` checks the traced step as a GPU would run it (host waits, collectives' device
types). ``cli`` is ``python -m upipe_dtensor.plan``.
"""
