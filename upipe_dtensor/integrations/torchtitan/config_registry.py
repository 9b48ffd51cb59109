"""torchtitan 0.3.0's ``--config`` functions with UPipe, for ``--module
upipe_dtensor.integrations.torchtitan`` (torchtitan's ``ConfigManager`` imports
``<module>.config_registry``): each of torchtitan's Llama3 and Qwen3 config functions by its own
name (``llama3_debugmodel``, ``llama3_8b``, ``qwen3_8b``, ...), returning its config as
``UPipeTrainer.Config`` (``tt030``)."""

from upipe_dtensor.integrations.torchtitan.tt030 import upipe_config_functions

globals().update(upipe_config_functions())
