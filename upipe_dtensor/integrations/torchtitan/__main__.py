"""``python -m upipe_dtensor.integrations.torchtitan``: torchtitan's own ``main`` with the
installed generation's plug-in (0.2.2: its ``UPipeTrainer``; 0.3.0: the ``--config`` function's
trainer, as ``-m torchtitan.train``)."""

from upipe_dtensor.integrations import torchtitan as plugin

plugin.main()
