"""Entry module of the webhook deliverer:
`celery -A deliverer.main worker --pool threads --queues iq.webhooks` (scripts/webhooks.sh).

Only the delivery task: no model, no batching dispatcher, no torch. It will not start while
webhooks are off (IQ_WEBHOOK_SECRET unset or the placeholder): it would sign deliveries with a
secret anyone can know.
"""
from __future__ import annotations

from celery import signals
from kombu import Queue

from tasks import logs
from tasks.celery_app import make_celery
from tasks.webhooks import QUEUE, SECRET_MISSING, enabled
from workers import broker
from workers.batching import stopping
from deliverer import metrics
from deliverer.webhooks import register

celery = make_celery(kinds=False)  # no model served: the `kinds:` modules (code) not imported
# Retries wait in the webhook queue's delayed set (deliverer/webhooks.py); fetches move them.
broker.attach(celery).delayed_queues.add(QUEUE)
if not enabled(celery.conf.iq_settings.webhook_secret):
    raise SystemExit(f"the webhook deliverer will not start: {SECRET_MISSING}")
celery.conf.task_queues = [Queue(QUEUE)]  # a worker started without -Q consumes deliveries
# A delivery in hand and the next for each thread: the models' prefetch (two full batches of
# the largest model a thread) would have one deliverer hold hundreds that another could send.
celery.conf.worker_prefetch_multiplier = 2
register(celery)
logs.configure_celery(celery.conf.iq_settings.log_format)


@signals.celeryd_after_setup.connect
def serve_metrics(sender: str, instance, conf, **_kw) -> None:
    """Only in the deliverer itself, not in `celery -A deliverer.main inspect`."""
    metrics.serve(conf.iq_settings)


@signals.worker_shutting_down.connect
def bounded_stop(sender: str, **_kw) -> None:
    """A stop (SIGTERM, SIGQUIT) ends within stop_timeout_s, also with Redis gone or frozen."""
    stopping.exit_within(celery.conf.iq_settings.stop_timeout_s, "the webhook deliverer")
