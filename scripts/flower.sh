#!/usr/bin/env bash
# Flower behind basic auth. The login (user:password) comes from FLOWER_BASIC_AUTH in the
# environment, which Flower reads as it reads every FLOWER_* option, so that the password is on
# no command line that `ps` shows. `make run` makes one and keeps it under var/secrets/.
#
# A stop (SIGTERM, SIGINT) ends within IQ_STOP_TIMEOUT_S: with its Redis frozen, Flower's
# threads each wait on Redis and hold its exit for minutes. Flower holds nothing of the jobs',
# so past that bound it is killed, saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${FLOWER_BASIC_AUTH:?set FLOWER_BASIC_AUTH=user:password (make run makes one)}"
export FLOWER_BASIC_AUTH
# One process, its metrics in memory: never the multiprocess files of a PROMETHEUS_MULTIPROC_DIR
# meant for the API's or a worker's processes (as scripts/webhooks.sh).
unset PROMETHEUS_MULTIPROC_DIR
.venv/bin/celery -A tasks.cli flower --address="${FLOWER_HOST:-127.0.0.1}" \
  --port="${FLOWER_PORT:-5555}" "$@" &
flower=$!
stop() {
  kill -TERM "$flower" 2>/dev/null || true
  local bound="${IQ_STOP_TIMEOUT_S:-25}" tenths
  tenths="$(awk -v s="$bound" 'BEGIN { printf "%d", s * 10 }')"
  for ((i = 0; i < tenths; i++)); do
    kill -0 "$flower" 2>/dev/null || exit 0
    sleep 0.1
  done
  echo "flower: still running ${bound}s into its stop (IQ_STOP_TIMEOUT_S): killed"
  kill -KILL "$flower" 2>/dev/null || true
  exit 1
}
trap stop TERM INT
wait "$flower"
