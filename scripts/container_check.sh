#!/usr/bin/env bash
# `make container-check`: builds the two images (Containerfile), starts the stack of
# compose.yaml with podman, checks that it serves a job, and takes it down again.
#
#   scripts/container_check.sh        build, compose, check, down (exit 0: the stack served)
#   scripts/container_check.sh env    only make var/secrets/ (as make run does) and
#                                     var/compose.env, which compose.yaml reads
#
# Where no image registry is reachable, the base image (BASE_IMAGE, default the official
# python:3.11-slim) and Redis's (REDIS_IMAGE) are made here with mmdebstrap from Debian
# bookworm's packages. This machine's pip configuration and local wheel folders, if any, are
# lent to the build. Containers run on the host's network when NETWORK=host (the default: a
# sandbox may have no container network), on free ports, started the first way that works
# here (see "how containers run here").
set -euo pipefail
cd "$(dirname "$0")/.."
var="${IQ_VAR_DIR:-var}"
mkdir -p -m 0700 "$var"

secret() {  # make run's kept secret: made on first use, 0600, the same on every later run
  local path="$var/secrets/$1"
  mkdir -p -m 0700 "$var/secrets"
  [ -s "$path" ] || (umask 077 && python3 -c 'import secrets; print(secrets.token_urlsafe(24))' > "$path")
  cat "$path"
}

write_env() {
  umask 077
  {
    echo "REDIS_APP_PASSWORD=$(secret redis-app-password)"
    echo "FLOWER_PASSWORD=$(secret flower-password)"
    echo "WEBHOOK_SECRET=$(secret webhook-secret)"
    secret redis-password > /dev/null
    for name in REDIS_HOST REDIS_PORT API_PORT FLOWER_PORT REDIS_IMAGE API_IMAGE WORKER_IMAGE; do
      [ -n "${!name:-}" ] && echo "$name=${!name}"
    done
  } > "$var/compose.env"
  echo "wrote $var/compose.env (from $var/secrets/)"
}

if [ "${1:-}" = env ]; then write_env; exit 0; fi
command -v podman > /dev/null || { echo "container check skipped: podman is not installed"; exit 77; }
# podman-compose: requirements/dev.txt's (Debian bookworm's 1.0.3 puts a host-network
# container on a bridge network too, which podman refuses), else PODMAN_COMPOSE's.
compose="${PODMAN_COMPOSE:-.venv/bin/podman-compose}"
[ -x "$compose" ] || command -v "$compose" > /dev/null || {
  echo "container check skipped: no $compose (make test installs it: requirements/dev.txt)"
  exit 77; }
compose=("$compose")

# -- base images ---------------------------------------------------------------------------
debian_image() {  # debian_image TAG PACKAGES: a bookworm image with PACKAGES, made here
  podman image exists "$1" && return 0
  command -v mmdebstrap > /dev/null || { echo "no registry and no mmdebstrap to make $1"; exit 1; }
  echo "making $1 with mmdebstrap (Debian bookworm: $2)"
  mmdebstrap --quiet --variant=minbase --include="$2" bookworm - | podman import - "$1"
}
pullable() { timeout 30 podman pull -q "$1" > /dev/null 2>&1; }
base="${BASE_IMAGE:-docker.io/library/python:3.11-slim}"
if ! podman image exists "$base" && ! pullable "$base"; then
  base=localhost/iq-base:bookworm
  debian_image "$base" python3,python3-venv,ca-certificates,passwd
fi
REDIS_IMAGE="${REDIS_IMAGE:-docker.io/library/redis:7.2-bookworm}"
if ! podman image exists "$REDIS_IMAGE" && ! pullable "$REDIS_IMAGE"; then
  REDIS_IMAGE=localhost/iq-redis:bookworm
  debian_image "$REDIS_IMAGE" redis-server,bash
fi
export REDIS_IMAGE

# -- the images ------------------------------------------------------------------------------
# This machine's pip configuration, the wheel folders and the certificate bundle it names,
# read-only, for the builds' pip.
cert="$(sed -n 's/^cert *= *//p' /etc/pip.conf 2>/dev/null | head -1)"
lend=()
for path in /etc/pip.conf /etc/xdg/pip /opt/pypi* /opt/wheels ${PIP_CERT:-} $cert; do
  [ -e "$path" ] && [[ " ${lend[*]} " != *" $path:$path:ro "* ]] && lend+=(--volume "$path:$path:ro")
done
export API_IMAGE=localhost/inference-queue-api:latest WORKER_IMAGE=localhost/inference-queue-worker:latest
for target in api worker; do
  image="localhost/inference-queue-$target:latest"
  old="$(podman image inspect --format '{{.Id}}' "$image" 2> /dev/null || true)"
  echo "building $image (base $base)"
  podman build --quiet --isolation chroot --build-arg "BASE=$base" \
    --build-arg "PIP_FIND_LINKS=${PIP_FIND_LINKS:-}" "${lend[@]}" --target "$target" \
    -t "$image" -f Containerfile . > /dev/null
  # The image it replaces, untagged now: gone, unless a container still uses it.
  if [ -n "$old" ] && [ "$old" != "$(podman image inspect --format '{{.Id}}' "$image")" ]; then
    podman rmi "$old" > /dev/null 2>&1 || true
  fi
done

# -- how containers run here ------------------------------------------------------------------
# The first that starts a container: as on any host; without cgroups; with runc and limits
# no higher than this machine's (a sandbox whose hybrid cgroups crun refuses, and which may
# not raise a limit).
run_args=""
for candidate in "" "--cgroups=disabled" \
    "--runtime runc --ulimit nofile=$(ulimit -Hn):$(ulimit -Hn) --ulimit nproc=32768:32768"; do
  # shellcheck disable=SC2086 # the candidate's words are separate arguments
  if podman run --rm $candidate --network host "$base" true > /dev/null 2>&1; then
    run_args="$candidate"; break
  fi
  run_args=none
done
[ "$run_args" = none ] && { echo "container check skipped: podman cannot start a container here"; exit 77; }

# -- what the images hold ----------------------------------------------------------------------
# Both run as the unprivileged user and have no pip and no compiler; the API's has no torch.
in_image() {  # in_image IMAGE COMMAND: COMMAND's output, run by bash in a container of IMAGE
  # shellcheck disable=SC2086 # the run arguments are separate words
  podman run --rm $run_args --network host --entrypoint bash "$1" -c "$2" 2>&1
}
for image in "$API_IMAGE" "$WORKER_IMAGE"; do
  user="$(in_image "$image" 'id -u')"
  [ "$user" != 0 ] || { echo "container check FAILED: $image runs as root"; exit 1; }
  tools="$(in_image "$image" 'for t in pip pip3 .venv/bin/pip gcc cc make; do command -v $t; done; true')"
  [ -z "$tools" ] || { echo "container check FAILED: $image has build tools: $tools"; exit 1; }
  echo "$image: $(podman image inspect --format '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1/1e6}'), runs as uid $user, no pip or compiler"
done
if in_image "$API_IMAGE" '.venv/bin/python -c "import torch"' > /dev/null; then
  echo "container check FAILED: the API image has torch"; exit 1
fi
echo "$API_IMAGE: no torch (import torch fails)"

# -- the stack ---------------------------------------------------------------------------------
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export NETWORK="${NETWORK:-host}" API_PORT="${API_PORT:-$(free_port)}"
export FLOWER_PORT="${FLOWER_PORT:-$(free_port)}" REDIS_PORT="${REDIS_PORT:-$(free_port)}"
files=(-f compose.yaml)
if [ "$NETWORK" = host ]; then
  export REDIS_HOST=127.0.0.1
  override="$var/compose.host.yaml"  # every service on the host's network
  printf 'services:\n' > "$override"
  for service in redis api worker webhooks flower; do
    printf '  %s: {network_mode: host}\n' "$service" >> "$override"
  done
  files+=(-f "$override")
fi
write_env
project="iqcheck$$"
up=("${compose[@]}" -p "$project" "${files[@]}" --env-file "$var/compose.env"
    "--podman-run-args=$run_args")
cleanup() { "${up[@]}" down -v > /dev/null 2>&1 || true; }
trap cleanup EXIT
"${up[@]}" up -d --no-build > "$var/compose-up.log" 2>&1 || { cat "$var/compose-up.log"; exit 1; }
running="$(podman ps --filter "label=io.podman.compose.project=$project" --format '{{.Names}}' | wc -l)"
[ "$running" = 5 ] || { tail -40 "$var/compose-up.log"
  echo "container check FAILED: $running of 5 containers running"; exit 1; }

api="http://127.0.0.1:$API_PORT"
echo "waiting for $api/readyz (the worker loads its model)"
for _ in $(seq 300); do
  curl -fsS "$api/readyz" > /dev/null 2>&1 && break
  sleep 1
done
if ! curl -fsS "$api/readyz" > /dev/null; then
  for service in redis api worker; do podman logs --tail 30 "${project}_${service}_1" 2>&1 || true; done
  echo "container check FAILED: the stack never became ready"; exit 1
fi
answer="$(curl -fsS -X POST "$api/v1/jobs" -H 'content-type: application/json' \
  -H 'Prefer: wait=30' -d '{"model": "minilm-embed", "inputs": ["hello from a container"]}')"
python3 - "$answer" <<'CHECK'
import json, sys
job = json.loads(sys.argv[1])
assert job["status"] == "succeeded", job
assert len(job["result"]["outputs"][0]) == 384, "not a 384-float embedding"
print(f"container check: job {job['id']} succeeded on model_version {job['model_version']} "
      f"(384 floats), worker {job.get('batch')}")
CHECK
curl -fsS -u "admin:$(secret flower-password)" "http://127.0.0.1:$FLOWER_PORT/api/workers" > /dev/null
echo "container check passed: Redis, API, worker, webhooks and Flower from the images served a job"
