#!/usr/bin/env bash
# The API under gunicorn: one process, many threads. The API is I/O-bound (Redis round trips,
# ?wait held open), so threads are what it needs, and one process keeps /metrics exact.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/gunicorn --bind "${IQ_HOST:-127.0.0.1}:${IQ_PORT:-8000}" \
  --worker-class gthread --workers "${IQ_WEB_WORKERS:-1}" --threads "${IQ_WEB_THREADS:-64}" \
  --timeout 60 --no-control-socket --access-logfile - 'app.wsgi:app'
