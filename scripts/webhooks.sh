#!/usr/bin/env bash
# The webhook deliverer: a light worker (threads, no model) on the iq.webhooks queue.
set -euo pipefail
cd "$(dirname "$0")/.."
export IQ_WORKER_METRICS_PORT="${IQ_WEBHOOK_METRICS_PORT:-0}"
exec .venv/bin/celery -A workers.main worker --pool threads \
  --concurrency "${IQ_WEBHOOK_CONCURRENCY:-8}" --queues iq.webhooks \
  --loglevel "${IQ_LOG_LEVEL:-INFO}" --hostname "webhooks@%h"
