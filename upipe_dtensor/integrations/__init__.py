"""Other trainers that run this project's CP styles: ``torchtitan`` (torchtitan's own ``Trainer``,
loaded through its ``--experimental.custom_import``)."""
