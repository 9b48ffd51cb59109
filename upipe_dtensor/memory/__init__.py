"""Memory-saving pieces of the long-context stack: activation checkpointing with host offload
(and the host store it parks tensors in), tiled MLP and RMSNorm, chunked output + cross-entropy."""
