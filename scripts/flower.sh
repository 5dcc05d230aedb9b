#!/usr/bin/env bash
# Flower behind basic auth. The login (user:password) comes from FLOWER_BASIC_AUTH in the
# environment, which Flower reads as it reads every FLOWER_* option, so that the password is on
# no command line that `ps` shows. `make run` makes one and keeps it under var/secrets/.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${FLOWER_BASIC_AUTH:?set FLOWER_BASIC_AUTH=user:password (make run makes one)}"
export FLOWER_BASIC_AUTH
exec .venv/bin/celery -A tasks.cli flower --address="${FLOWER_HOST:-127.0.0.1}" \
  --port="${FLOWER_PORT:-5555}" "$@"
