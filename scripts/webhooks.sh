#!/usr/bin/env bash
# The webhook deliverer: a light worker (threads, no model) on the iq.webhooks queue. It will
# not start until IQ_WEBHOOK_SECRET is set.
set -euo pipefail
cd "$(dirname "$0")/.."
# One process, its metrics in a registry of its own (deliverer/metrics.py): prometheus_client,
# which the celery command imports before the app, would write them into the multiprocess files
# of a PROMETHEUS_MULTIPROC_DIR meant for the API's or a worker's processes (into the working
# folder when it is set but empty; failing when it is missing).
unset PROMETHEUS_MULTIPROC_DIR
exec .venv/bin/celery -A deliverer.main worker --pool threads \
  --concurrency "${IQ_WEBHOOK_CONCURRENCY:-8}" --queues iq.webhooks \
  --loglevel "${IQ_LOG_LEVEL:-INFO}" --hostname "webhooks@%h"
