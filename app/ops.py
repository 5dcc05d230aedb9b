"""Operational endpoints: liveness, readiness (with dependency checks), models, metrics."""
from __future__ import annotations

import redis
from flask import current_app, jsonify

from app.docs import Blueprint, Models

bp = Blueprint("ops", __name__, description="Liveness, readiness, models and metrics")
_TEXT = {"content": {"text/plain": {"schema": {"type": "string"}}}}


def _ext(name: str):
    return current_app.extensions[name]


@bp.get("/healthz")
@bp.doc(responses={"200": {"description": "alive"}})
def healthz():
    return jsonify({"status": "ok"})


@bp.get("/readyz")
@bp.doc(responses={"200": {"description": "ready"}, "503": {"description": "not ready"}})
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
@bp.response(200, Models, description="every configured model: its input kind, limits and "
                                      "live instances")
def list_models():
    models = _ext("iq.models")
    live = _ext("iq.store").live(models)
    return jsonify({"revision": _ext("iq.revision"),
                    "models": [{**spec.public(), **live[name]} for name, spec in models.items()]})


@bp.get("/metrics")
@bp.doc(responses={"200": {"description": "Prometheus text format", **_TEXT}})
def metrics():
    return _ext("iq.metrics").render()
