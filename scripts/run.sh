#!/usr/bin/env bash
# `make run`: the whole stack under honcho (scripts/run.py). With REDIS_URL naming a running
# Redis, use it and start none; otherwise start the Procfile's own Redis.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m scripts.run "$@"
