"""Operational endpoints: liveness, readiness (with dependency checks), models, metrics."""
from __future__ import annotations

import redis
from flask import Blueprint, current_app, jsonify

bp = Blueprint("ops", __name__)


def _ext(name: str):
    return current_app.extensions[name]


@bp.get("/healthz")
def healthz():
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz():
    """Ready when Redis answers and every model has at least one live instance: a pool child
    with the model loaded, in a worker whose main process is consuming."""
    store = _ext("iq.store")
    checks: dict[str, dict] = {}
    try:
        store.ping()
        checks["redis"] = {"ok": True}
        live = store.live(_ext("iq.models"))
    except redis.RedisError:
        checks["redis"] = {"ok": False, "error": "unreachable"}
        live = {}
    for name in _ext("iq.models"):
        count = live.get(name, {}).get("instances", 0)
        checks[f"model:{name}"] = {"ok": count > 0, "instances": count}
    ready = all(c["ok"] for c in checks.values())
    body = {"status": "ready" if ready else "not_ready", "checks": checks}
    if ready:
        return jsonify(body)
    return jsonify(body), 503, {"Retry-After": "5"}


@bp.get("/v1/models")
def list_models():
    models = _ext("iq.models")
    live = _ext("iq.store").live(models)
    return jsonify({"models": [{**spec.public(), **live[name]} for name, spec in models.items()]})


@bp.get("/openapi.json")
def openapi_document():
    from app.openapi import openapi

    return jsonify(openapi(_ext("iq.models")))


@bp.get("/metrics")
def metrics():
    return _ext("iq.metrics").render()
