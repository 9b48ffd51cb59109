"""UPipe (and Ulysses, ring, FPDT, UPipe x FPDT) inside torchtitan's own trainer, on the installed
torchtitan generation (``models.generation``): one module each, with what both share in
``common``.

- torchtitan 0.2.2 (``tt022``): importing this package registers the ``llama3_upipe`` and
  ``qwen3_upipe`` train specs (``--experimental.custom_import``) and gives torchtitan's
  ``ConfigManager`` the ``[upipe]`` section (``--job.custom_config_module``);
  ``python -m upipe_dtensor.integrations.torchtitan`` runs torchtitan's main with the plug-in's
  trainer.
- torchtitan 0.3.0 (``tt030``): ``--module upipe_dtensor.integrations.torchtitan --config F``
  takes any of torchtitan's Llama3 and Qwen3 config functions ``F`` (``config_registry``),
  returning the plug-in's trainer config with the ``[upipe]`` section.

docs/torchtitan.md shows both.
"""

import importlib

from upipe_dtensor.models.generation import GENERATION

_plugin = importlib.import_module(f"{__name__}.{GENERATION}")
globals().update({name: getattr(_plugin, name) for name in _plugin.__all__})
__all__ = list(_plugin.__all__)
