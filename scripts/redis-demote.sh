#!/usr/bin/env bash
# The sentinels' client-reconfig-script (scripts/redis-server.sh names it in each sentinel's
# configuration). Sentinel runs it once a failover has promoted a replica, with
#   <master-name> <role> <state> <from-ip> <from-port> <to-ip> <to-port>
# (role `leader` for the sentinel that made the failover, on the promotion; `observer` for the
# others, when they learn of it), and this makes the replaced primary (from) a replica of the
# promoted one (to) at once, closing its clients' connections, as Sentinel itself does only
# when it next reads the old primary's INFO past 8 s after it first saw it claim the primary's
# role: about 10 s after the promotion. Meanwhile the promoted node has no replica, so with
# min-replicas-to-write (make run with replicas) it refuses every write and no submit is
# accepted.
#
# Safe for what was confirmed: a write a replica confirmed (WAIT) is on the promoted node, and
# the old primary has refused writes since its replica left it (min-replicas-to-write); what it
# drops on resyncing is what no replica confirmed. It acts only when the sentinel running it
# names `to` as the primary and `to` answers that it is one, so a late or repeated call never
# points a node at anything but the primary of now; every sentinel calls it, and a node
# already a replica of `to` is told so again, which changes nothing.
#
# Runs in the sentinel's environment (scripts/redis-server.sh's): the admin's password in
# IQ_REDIS_PASSWORD_FILE, the sentinel's own port in REDIS_PORT. Exit status 2 (Sentinel
# logs -script-error and does not retry) when it could not demote the old primary: one that
# is down is demoted by Sentinel when it is back, or starts as a replica (redis-server.sh).
set -uo pipefail
if [ $# -ne 7 ]; then
  echo "usage: $0 <master-name> <role> <state> <from-ip> <from-port> <to-ip> <to-port>" >&2
  exit 2
fi
master="$1" role="$2" state="$3" old_host="$4" old_port="$5" new_host="$6" new_port="$7"
say() { echo "redis-demote: $master $old_host:$old_port -> $new_host:$new_port ($role): $*" >&2; }
[ "$state" = start ] || exit 0
# The addresses go into the lines piped to redis-cli below: a host or port that is not one
# (a space or a line break in it would add words or commands there) stops the script.
for host in "$old_host" "$new_host"; do
  if [[ ! "$host" =~ ^[A-Za-z0-9.:_-]+$ ]]; then say "not demoted: '$host' is not a host"; exit 2; fi
done
for port in "$old_port" "$new_port"; do
  if [[ ! "$port" =~ ^[0-9]{1,5}$ ]]; then say "not demoted: '$port' is not a port"; exit 2; fi
done

# The redis-cli beside the sentinel's own redis-server (its parent: Sentinel forks and execs
# this), else the system's.
cli_bin="$(dirname "$(readlink -f "/proc/$PPID/exe" 2> /dev/null || echo /)")/redis-cli"
[ -x "$cli_bin" ] || cli_bin="$(command -v redis-cli)"
# A missing setting exits 2 too: with 1, Sentinel would run the script again, up to 10 times.
if [ ! -r "${IQ_REDIS_PASSWORD_FILE:-}" ] || [ -z "${REDIS_PORT:-}" ]; then
  say "not demoted: IQ_REDIS_PASSWORD_FILE must name a readable file with the admin password" \
      "and REDIS_PORT the sentinel's port (got '${IQ_REDIS_PASSWORD_FILE:-}', '${REDIS_PORT:-}')"
  exit 2
fi
REDISCLI_AUTH="$(< "$IQ_REDIS_PASSWORD_FILE")"
export REDISCLI_AUTH
# At most 5 s a command: a frozen node must not hold the script (Sentinel kills it at 60 s).
cli() { timeout 5 "$cli_bin" -h "$1" -p "$2" "${@:3}"; }

named="$(cli 127.0.0.1 "$REDIS_PORT" \
         SENTINEL GET-MASTER-ADDR-BY-NAME "$master" | paste -sd:)"
if [ "$named" != "$new_host:$new_port" ]; then
  say "not demoted: this sentinel names ${named:-no primary} now"
  exit 2
fi
if [ "$(cli "$new_host" "$new_port" ROLE | head -n 1)" != master ]; then
  say "not demoted: $new_host:$new_port does not answer as a primary"
  exit 2
fi
# One transaction, as Sentinel's own demotion: the replica's role and no client left on it
# (each reconnects through the sentinels, to the promoted node; CLIENT KILL skips this one).
printf '%s\n' MULTI "REPLICAOF $new_host $new_port" "CLIENT KILL TYPE normal" \
  "CLIENT KILL TYPE pubsub" EXEC | cli "$old_host" "$old_port" > /dev/null
now="$(cli "$old_host" "$old_port" ROLE | head -n 3 | paste -sd' ')"
if [ "$now" != "slave $new_host $new_port" ]; then
  say "not demoted: it answers '${now:-nothing}'"
  exit 2
fi
say "demoted: a replica of the promoted node"
