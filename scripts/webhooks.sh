#!/usr/bin/env bash
# The webhook deliverer: a light worker (threads, no model) on the iq.webhooks queue. It will
# not start until IQ_WEBHOOK_SECRET is set.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/celery -A deliverer.main worker --pool threads \
  --concurrency "${IQ_WEBHOOK_CONCURRENCY:-8}" --queues iq.webhooks \
  --loglevel "${IQ_LOG_LEVEL:-INFO}" --hostname "webhooks@%h"
