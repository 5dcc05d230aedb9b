"""The HTTP API: validates jobs and queues them as Celery tasks, by name. No torch here."""
from __future__ import annotations

from typing import Any, Mapping

from flask import Flask

from config import load_models, load_settings
from tasks import tracing
from tasks.celery_app import make_celery
from tasks.logs import configure as configure_logging


def create_app(overrides: Mapping[str, Any] | None = None) -> Flask:
    settings = load_settings(overrides)
    models = load_models(settings.models_file)

    from app import auth, errors, jobs, ops
    from app.json_provider import OrjsonProvider
    from app.metrics import ApiMetrics
    from app.schemas import job_schema
    from app.store import JobStore

    app = Flask(__name__)
    app.config.update(IQ_SETTINGS=settings, MAX_CONTENT_LENGTH=settings.max_body_bytes)
    app.json = OrjsonProvider(app)
    configure_logging(settings.log_level)
    if tracing.setup("inference-queue-api"):
        # Before the blueprints: each request's span is open when the views run, so a job's
        # trace id is its request's.
        from opentelemetry.instrumentation.flask import FlaskInstrumentor
        from opentelemetry.instrumentation.redis import RedisInstrumentor

        FlaskInstrumentor().instrument_app(app)
        RedisInstrumentor().instrument()

    celery = make_celery(settings)
    store = JobStore(settings, celery, models)
    app.extensions.update({
        "celery": celery,
        "iq.models": models,
        "iq.schemas": {name: job_schema(spec) for name, spec in models.items()},
        "iq.store": store,
        "iq.metrics": ApiMetrics(store.queue_depths),
    })
    app.extensions["iq.metrics"].init_app(app)
    errors.register_error_handlers(app)
    auth.init_app(app, auth.load_keys(settings.api_keys_file))
    app.register_blueprint(jobs.bp)
    app.register_blueprint(ops.bp)
    return app
