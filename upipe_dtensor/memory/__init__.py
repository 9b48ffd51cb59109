"""Memory-saving pieces of the long-context stack: activation checkpointing with host offload
(``offload``), attention kept from forward for the recompute (``kept_attention``), tiled MLP
(``tiled_mlp``) and RMSNorm (``rms_norm``), chunked output + cross-entropy (``chunked_loss``).
The host store they park tensors in is ``runtime.host_store``."""
