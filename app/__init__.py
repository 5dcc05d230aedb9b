"""The HTTP API: validates jobs and queues them as Celery tasks, by name. No torch here."""
from __future__ import annotations

from typing import Any, Mapping

from flask import Flask

from config import load_settings
from config.models import read_models
from tasks import redis_deadline, tracing
from tasks.logs import configure as configure_logging


def create_app(overrides: Mapping[str, Any] | None = None) -> Flask:
    settings = load_settings(overrides)
    models, revision = read_models(settings.models_file)

    from app import auth, errors, events, job_actions, jobs, openapi, ops, trace_ids
    from app.application import Api
    from app.group_stores import Stores
    from app.json_provider import OrjsonProvider
    from app.limits import ReadBudget, Uploads
    from app.metrics import ApiMetrics
    from app.submission import Submitter

    app = Api(__name__)
    # `//v1//models` is a 404 in the JSON envelope, not Werkzeug's 308 (an HTML body, and a
    # Location built from whatever Host the client sent).
    app.url_map.merge_slashes = False
    app.config.update(MAX_CONTENT_LENGTH=settings.max_body_bytes)
    app.json = OrjsonProvider(app)
    configure_logging(settings.log_level, settings.log_format)
    if tracing.setup("inference-queue-api"):
        # Before the blueprints: each request's span is open when the views run, so a job's
        # trace id is its request's.
        from opentelemetry.instrumentation.flask import FlaskInstrumentor
        from opentelemetry.instrumentation.redis import RedisInstrumentor

        FlaskInstrumentor().instrument_app(app)
        RedisInstrumentor().instrument()

    store = Stores(settings, models, revision)  # one job store per Redis group
    celery = store.default.celery
    metrics = ApiMetrics(store.queue_depths, lambda: store.waiter.waiting, settings.max_waits,
                         store.kept)
    submitter = Submitter(settings, models, store, metrics)
    app.extensions.update({"celery": celery, "iq.models": models, "iq.revision": revision,
                           "iq.store": store,
                           "iq.metrics": metrics, "iq.submitter": submitter})
    metrics.init_app(app)
    trace_ids.init_app(app)
    keys = auth.load_keys(settings.api_keys_file)
    auth.init_app(app, keys, ReadBudget(settings.read_rate_per_key, settings.read_burst_per_key))
    app.extensions["iq.uploads"] = Uploads(settings.max_uploads_per_key)
    api = openapi.init_app(app, models, submitter.schemas)
    routes = jobs.blueprint(settings, models, bool(keys))
    job_actions.register(routes, bool(keys))
    events.register(routes, settings, bool(keys))
    api.register_blueprint(routes)
    api.register_blueprint(ops.blueprint(bool(keys)))
    # After flask-smorest's: app/errors.py answers every error, theirs included.
    errors.register_error_handlers(app)
    _one_deadline(app, settings.redis_deadline_s)
    return app


def _one_deadline(app: Flask, seconds: float) -> None:
    """Each request, from its first hook to its answer, under one Redis deadline
    (tasks/redis_deadline.py): its calls on every Redis share `seconds`. What an event stream
    reads once its answer has begun, each call is bounded on its own."""
    inner = app.wsgi_app

    def wsgi_app(environ, start_response):
        with redis_deadline.deadline(seconds):
            return inner(environ, start_response)

    app.wsgi_app = wsgi_app  # type: ignore[method-assign]
