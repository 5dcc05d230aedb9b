"""Operational endpoints: liveness, readiness (with dependency checks), models, metrics."""
from __future__ import annotations

from flask import current_app

from app.openapi import REQUEST_ID, RETRY_AFTER, Blueprint, errors
from app.responses import Health, Models, Readiness, answer

_TEXT = {"content": {"text/plain": {"schema": {"type": "string"}}}}


def _ext(name: str):
    return current_app.extensions[name]


def blueprint(keys: bool) -> Blueprint:
    """The probes, the models and the metrics (`keys`: whether API keys are configured: the
    probes and metrics stay open, /v1/models does not)."""
    bp = Blueprint("ops", __name__, description="Liveness, readiness, models and metrics")

    @bp.get("/healthz")
    @bp.response(200, Health, description="alive")
    def healthz():
        return answer(Health, {"status": "ok"})

    @bp.get("/readyz")
    @bp.response(200, Readiness, description="ready")
    @bp.alt_response(503, schema=Readiness, description="not ready: `checks` says what fails",
                     headers={"Retry-After": RETRY_AFTER})
    def readyz():
        """Ready when Redis answers (each Redis group's too: `redis:<group>`) and every model
        has at least one live instance: a pool child with the model loaded, in a worker that
        consumes the model's queue."""
        ready, body = _readiness()
        return answer(Readiness, body) if ready else \
            answer(Readiness, body, 503, {"Retry-After": "5"})

    @bp.get("/v1/models")
    @bp.doc(operationId="listModels")
    @bp.response(200, Models, description="every configured model: its input kind, limits "
                                          "and live instances",
                 headers={"X-Request-ID": REQUEST_ID})
    @errors(bp, keys)
    def list_models():
        models = _ext("iq.models")
        live = _ext("iq.store").live(models)
        return answer(Models, {"revision": _ext("iq.revision"),
                               "models": [{**spec.public(), **live[name]}
                                          for name, spec in models.items()]})

    @bp.get("/metrics")
    @bp.doc(responses={"200": {"description": "Prometheus text format", **_TEXT}})
    def metrics():
        return _ext("iq.metrics").render()

    return bp


def _readiness() -> tuple[bool, dict]:
    checks, live = _ext("iq.store").readiness(_ext("iq.models"))
    for name in _ext("iq.models"):
        count = live.get(name, {}).get("instances", 0)
        checks[f"model:{name}"] = {"ok": count > 0, "instances": count}
    ready = all(c["ok"] for c in checks.values())
    return ready, {"status": "ready" if ready else "not_ready", "checks": checks}
