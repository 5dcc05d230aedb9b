"""The webhook deliverer: a service of its own (`celery -A deliverer.main worker --pool
threads`, scripts/webhooks.sh) that POSTs each finished job's signed result to the URL its
client gave. No model, no batching, no torch."""
