"""Benchmarks: the service against the naive design and celery-batches, side by side."""
