#!/usr/bin/env bash
# `make run`: the whole stack under honcho. With REDIS_URL naming a running Redis, use it and
# start none; otherwise start the Procfile's own Redis.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ -n "${REDIS_URL:-}" ]; then
  echo "Using the Redis at REDIS_URL; not starting one."
  exec .venv/bin/honcho start web worker webhooks flower
fi
export REDIS_URL="redis://127.0.0.1:${REDIS_PORT:-6379}/0"
exec .venv/bin/honcho start
