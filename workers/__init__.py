"""GPU workers: the batching strategy (main process) and the model runtime (pool children)."""
