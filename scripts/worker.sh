#!/usr/bin/env bash
# One Celery worker for the configured models' queues. One pool child per GPU (each child owns
# one device), or one child on a CPU-only host; IQ_WORKER_CONCURRENCY overrides. The GPU count
# comes from nvidia-smi, a separate process, so this parent never initialises CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
concurrency="${IQ_WORKER_CONCURRENCY:-$(( gpus > 0 ? gpus : 1 ))}"
queues=()
[ -n "${IQ_WORKER_QUEUES:-}" ] && queues=(--queues "$IQ_WORKER_QUEUES")
exec .venv/bin/celery -A workers.main worker --pool prefork --concurrency "$concurrency" \
  --loglevel "${IQ_LOG_LEVEL:-INFO}" --hostname "${IQ_WORKER_NAME:-worker}@%h" "${queues[@]}" "$@"
