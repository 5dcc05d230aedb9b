"""Entry module for the `celery` CLI and Flower: `celery -A tasks.cli inspect active`.

It only sends and inspects; the workers use `workers.main`, which also registers the
batching tasks. It routes by a model's name and queue only, so the models file's `kinds:`
modules (code) are not imported here."""
from tasks.celery_app import make_celery

celery = make_celery(kinds=False)
