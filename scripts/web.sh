#!/usr/bin/env bash
# The API under gunicorn, with gunicorn.conf.py's settings: the gevent worker, so that each
# request (a waiting one above all) is a greenlet rather than a thread; a process per four cores
# by default (IQ_WEB_WORKERS), their /metrics summed (gunicorn.conf.py).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/gunicorn --bind "${IQ_HOST:-127.0.0.1}:${IQ_PORT:-8000}" \
  --access-logfile - 'app.wsgi:app'
