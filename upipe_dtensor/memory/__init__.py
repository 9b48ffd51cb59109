"""Memory-saving pieces of the long-context stack: activation offload, tiled MLP, chunked loss."""
