"""Every mode the planner and the stand-in run turn on in the runtime, in one place (issue 48).

A mode is a process-wide setting a plan or a stand-in run changes for a while, around the job's
real step, and the runtime reads: each lives in one module here, with the context manager that
turns it on and the named function the runtime asks it through; no runtime module keeps one as
its own global or reads another's. This package is the layer just above ``errors``: it imports
nothing else of the package, so ``runtime``, ``kernels``, ``memory`` and ``parallel`` may ask it,
and none of them imports ``planning`` for it.

- ``fake_group``: exchanges over a fake process group fill their outputs with local data (the
  stand-in run);
- ``rehearsal``: the device-runtime seam's copies take their CUDA branch on the planner's
  stand-ins (a plan of a CUDA job), and compiled tile kernels run with the rehearsal's
  torch-function mode off;
- ``ops``: the project's custom ops run their Python bodies in the open, for the planner's
  tracker, and the attention ops' computations go through the planner's runner;
- ``loops``: the tile and chunk loops' shortcut on fake tensors, and what a visited iteration
  stands for;
- ``compiles``: the plans of a search share their compiled graphs;
- ``traces``: the runtime's caches of tensors (``parallel.head_stages.head_index``), emptied
  between the planner's traces.

Not a mode but the planner's too: its count of what a CUDA attention backward allocates inside
enters the kernels at one named call (``kernels.traced_workspace.backward_workspace_held``), kept
there because it asks whether a tensor is fake (``runtime.torch_private``, above this package).
Every other fake-tensor test below the planner is a branch fake tensors need to run at all;
``tests/test_modes.py`` lists each with why, so a new one is a decision.
"""
