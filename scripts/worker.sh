#!/usr/bin/env bash
# One Celery worker for the configured models' queues (several may run on one host: each gets
# a node name and a metrics port of its own). IQ_CHILDREN_PER_GPU pool children per GPU (1 by
# default: each child owns one device), or one child on a CPU-only host; IQ_WORKER_CONCURRENCY
# overrides. The GPUs are counted as the worker counts them (workers/child/devices.py:
# IQ_GPU_COUNT, else nvidia-smi, a separate process, so that this parent never initialises CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
children="$(.venv/bin/python -m workers.child.devices)"
concurrency="${IQ_WORKER_CONCURRENCY:-$(( children > 0 ? children : 1 ))}"
queues=()
[ -n "${IQ_WORKER_QUEUES:-}" ] && queues=(--queues "$IQ_WORKER_QUEUES")
# A node name no other worker has (liveness is counted per node name): IQ_WORKER_NAME, else
# gpu<i> for a worker given one GPU (CUDA_VISIBLE_DEVICES=<i>), else worker-<its pid> ($$ is
# the worker's pid: exec keeps it); then @<host name>.
name="${IQ_WORKER_NAME:-}"
if [ -z "$name" ]; then
  if [[ "${CUDA_VISIBLE_DEVICES:-}" =~ ^[0-9]+$ ]]; then name="gpu$CUDA_VISIBLE_DEVICES"
  else name="worker-$$"; fi
fi
exec .venv/bin/celery -A workers.main worker --pool prefork --concurrency "$concurrency" \
  --loglevel "${IQ_LOG_LEVEL:-INFO}" --hostname "$name@%h" "${queues[@]}" "$@"
