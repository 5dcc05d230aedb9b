"""What runs in a worker's main process (no torch, no CUDA): the Strategy that buffers each
model's messages, the dispatcher that batches them onto the pool children and settles what comes
back, and what keeps it alive and bounded (liveness, watchdog, isolation, stopping, reload)."""
