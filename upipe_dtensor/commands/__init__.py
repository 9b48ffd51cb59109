"""The user commands' bodies, above ``planning`` (``tests/test_layering.py``): ``evaluate`` (loss
by position) and ``retrieval`` (its ``--task``), sharing ``eval_common``; ``convert`` (snapshot
<-> Hugging Face folder). They build their models through ``upipe_dtensor.train.build``.

Each command's name on the command line is a module at the package top
(``python -m upipe_dtensor.evaluate``, ``.convert``), with its ``[project.scripts]`` entry point
(``upipe-evaluate``, ``upipe-convert``); the planner's, the data commands' and ``gpu_check``'s
bodies live with their packages (``planning.cli``, ``data.report``, ``data.tokenize``,
``verify.gpu_check``).
"""
