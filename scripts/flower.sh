#!/usr/bin/env bash
# Flower behind basic auth. With FLOWER_BASIC_AUTH (user:password) unset, a random password is
# made and printed once, here, at start.
set -euo pipefail
cd "$(dirname "$0")/.."
auth="${FLOWER_BASIC_AUTH:-}"
if [ -z "$auth" ]; then
  password="$(.venv/bin/python -c 'import secrets; print(secrets.token_urlsafe(18))')"
  auth="admin:${password}"
  echo "Flower login: user 'admin', password '${password}' (set FLOWER_BASIC_AUTH=user:password to choose)"
fi
export FLOWER_BASIC_AUTH="$auth"
exec .venv/bin/celery -A tasks.app flower --address="${FLOWER_HOST:-127.0.0.1}" \
  --port="${FLOWER_PORT:-5555}" --basic-auth="$auth" "$@"
