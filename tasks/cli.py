"""Entry module for the `celery` CLI and Flower: `celery -A tasks.cli inspect active`.

It only sends and inspects; the workers use `workers.main`, which also registers the
batching tasks."""
from tasks.celery_app import make_celery

celery = make_celery()
