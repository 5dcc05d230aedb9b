"""API keys (`Authorization: Bearer <key>`), who owns a job, and per-key rate limits: the
key's submits (its `rate_per_s`, in Redis: shared by every API process) and its reads (the
process's ReadBudget, app/limits.py: every /v1 request but a submit).

Keys are configured hashed (SHA-256, hex) in the file IQ_API_KEYS_FILE names; when it lists
any key, every /v1 route needs one. A job belongs to the key that created it: another key
gets 404 for it. Keys are never logged.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import redis
import yaml
from flask import Flask, current_app, g, request

from app.errors import Forbidden, RateLimited, Unauthorized
from app.limits import OverBudget, ReadBudget
from config import ConfigError
from tasks.lua import script


@dataclass(frozen=True)
class ApiKey:
    name: str
    sha256: str
    models: frozenset[str] | None = None  # None: every model
    rate_per_s: float = 0.0  # 0: no limit
    burst: int = 0


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_keys(path: str) -> dict[str, ApiKey]:
    """sha256 → key. An empty path means no keys: the API is open. A key's name owns its jobs
    and its rate bucket, so names must differ."""
    if not path:
        return {}
    data = yaml.safe_load(Path(path).read_text()) or {}
    keys: dict[str, ApiKey] = {}
    names: dict[str, int] = {}
    for i, raw in enumerate(data.get("keys") or []):
        where = f"{path}: keys[{i}]"
        digest = str(raw.get("sha256", "")).lower()
        if not raw.get("name") or len(digest) != 64:
            raise ConfigError(f"{where}: needs `name` and `sha256` (64 hex digits)")
        name = str(raw["name"])
        if name in names:
            raise ConfigError(f"{where}.name {name!r} is already the name of keys[{names[name]}]; "
                              "each key needs its own (it owns jobs and a rate bucket)")
        if digest in keys:
            raise ConfigError(f"{where}.sha256 is already the hash of key "
                              f"{keys[digest].name!r}")
        names[name] = i
        models = raw.get("models")
        try:
            rate = float(raw.get("rate_per_s", 0))
            burst = int(raw.get("burst", max(1, math.ceil(rate))))
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: rate_per_s must be a number and burst an integer, got "
                              f"{raw.get('rate_per_s')!r} and {raw.get('burst')!r}") from None
        if rate < 0:
            raise ConfigError(f"{where}.rate_per_s must be >= 0, got {rate:g}")
        if rate > 0 and burst < 1:
            raise ConfigError(f"{where}.burst must be an integer >= 1 with a rate_per_s, "
                              f"got {burst}")
        keys[digest] = ApiKey(name, digest, frozenset(models) if models is not None else None,
                              rate, burst)
    return keys


# Token bucket (tasks/lua/rate_take.lua): 0 when a token was taken, else the seconds until one
# will be there.
_TAKE = script("rate_take")


def take_token(client: redis.Redis, key: ApiKey) -> float:
    if key.rate_per_s <= 0:
        return 0.0
    wait = client.eval(_TAKE, 1, f"iq:rate:{key.name}", key.rate_per_s, key.burst, time.time())
    return float(wait)


def current_key() -> ApiKey | None:
    """The key of the request being served (None when keys are off)."""
    return g.get("api_key")


def current_owner() -> str:
    key = current_key()
    return key.name if key else ""


def check_model(key: ApiKey | None, model: str) -> None:
    if key is not None and key.models is not None and model not in key.models:
        raise Forbidden(f"this API key may not use model {model!r}")


def check_rate(client: redis.Redis, key: ApiKey | None) -> None:
    if key is None:
        return
    wait = take_token(client, key)
    if wait > 0:
        raise RateLimited(f"rate limit of {key.rate_per_s:g} jobs/s for this key",
                          retry_after=max(1, math.ceil(wait)))


# The views that charge the key themselves: a submit takes a submit token (check_rate), a
# listing pays for what its page may scan (charge_read).
_CHARGED_BY_VIEW = frozenset({"jobs.submit_job", "jobs.list_jobs"})


def charge_read(key: ApiKey | None, cost: int = 1) -> None:
    """Take `cost` from the key's read budget (none without a key), or 429 with Retry-After."""
    if key is None:
        return
    reads: ReadBudget = current_app.extensions["iq.reads"]
    try:
        reads.charge(key.name, cost)
    except OverBudget as exc:
        raise RateLimited(
            f"read budget of {reads.rate:g} a second for this key on this API process "
            f"(read_rate_per_key): this request costs {min(cost, reads.burst)} (a listing "
            "what its page may scan, any other request 1)",
            retry_after=exc.retry_after) from None


def init_app(app: Flask, keys: dict[str, ApiKey], reads: ReadBudget | None = None) -> None:
    app.extensions["iq.keys"] = keys
    app.extensions["iq.reads"] = reads or ReadBudget(0, 0)

    @app.before_request
    def _authenticate() -> None:
        g.api_key = None
        keys_ = app.extensions["iq.keys"]  # this app's: no look-up of current_app
        if not keys_ or not request.path.startswith("/v1/"):
            return
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("an API key is required: Authorization: Bearer <key>")
        key = keys_.get(hash_key(token.strip()))
        if key is None:
            raise Unauthorized("unknown API key")
        g.api_key = key

    @app.before_request
    def _charge_read() -> None:
        if g.api_key is not None and request.endpoint not in _CHARGED_BY_VIEW:
            charge_read(g.api_key)
