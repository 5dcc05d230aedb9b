"""A worker's prefetch: what it holds unacknowledged is two full batches per pool child of the
largest model IT serves (tasks/celery_app.py `prefetch_multiplier`; IQ_PREFETCH_MULTIPLIER,
when set, wins), not of the largest in its models file: a worker started with -Q for a model
of batch 4 beside one of batch 32 would hold 64 jobs a child, which another worker could run.

Celery sizes the prefetch from `worker_prefetch_multiplier` (the whole file's: a worker
consuming every queue) before the worker's queues are applied to anything; then:

* at start, `celeryd_after_setup` (workers/main.py `select_models`), once the worker's -Q
  is known and before its consumer connects, sets the multiplier of the models it serves
  (`fit`): the consumer's Tasks bootstep sets the channel's QoS from it at each connection,
  a reconnect's included;
* while it runs, the dispatcher (`PoolDispatcher.fit_prefetch`) sizes it again when the
  models it serves change: a reload (a model added to a worker consuming every queue, a
  batch size changed, a model removed: a removed model's queue stays consumed, its jobs
  failing as they arrive, and it counts no more) or a queue added or cancelled by `celery
  control add_consumer/cancel_consumer` (looked at each tick). It raises or lowers the live
  QoS; a lowered one fetches nothing until the worker holds less than the new count.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

from kombu.common import PREFETCH_COUNT_MAX

from config.calibration import effective_batch_size, on_gpu
from config.models import ModelSpec
from tasks.celery_app import prefetch_multiplier

logger = logging.getLogger(__name__)


def served(models: dict[str, ModelSpec], queues: Iterable[str]) -> list[ModelSpec]:
    """The models of `models` whose queue is among `queues`."""
    consumed = set(queues)
    return [spec for spec in models.values() if spec.queue in consumed]


def fit_served(consumer: Any, settings: Any, specs: Iterable[ModelSpec], gpus: int) -> bool:
    """`fit` for a worker serving `specs` with `gpus` GPUs visible: two full batches per child
    of the largest of them, each on a GPU the calibrator's (config/calibration.py)."""
    return fit(consumer, prefetch_multiplier(settings, (
        effective_batch_size(spec, settings, on_gpu(spec, gpus)) for spec in specs)))


def fit(consumer: Any, multiplier: int) -> bool:
    """`consumer` (Celery's worker consumer) holds `multiplier` messages per pool child from
    now (no more than keeps that count within kombu's PREFETCH_COUNT_MAX, past which it
    switches the QoS off): its multiplier (by which `control pool_grow`/`pool_shrink` and the
    autoscaler move the prefetch), the count its Tasks bootstep sets the channel's QoS to at each
    connection (`initial_prefetch_count`: the children Celery counted it for, times the
    multiplier) and, once connected, its live QoS, which the event loop hands the channel at
    its next turn (celery/worker/loops.py). False when it held that many already."""
    before = consumer.prefetch_multiplier
    if multiplier < 1:
        return False
    # Celery keeps initial_prefetch_count = children × multiplier (the worker's
    # worker_enable_prefetch_count_reduction=False keeps a reconnect from lowering it).
    children = max(consumer.initial_prefetch_count // before, 1) if before > 0 else 1
    # Past PREFETCH_COUNT_MAX kombu switches the QoS off: the worker would take every job
    # waiting (a large batch, many children), so it holds at most that many.
    multiplier = min(multiplier, max(PREFETCH_COUNT_MAX // children, 1))
    count = children * multiplier
    if multiplier == before and consumer.initial_prefetch_count == count:
        return False
    consumer.prefetch_multiplier = multiplier
    consumer.initial_prefetch_count = count
    qos = getattr(consumer, "qos", None)
    if qos is not None:
        qos.value = count
    logger.info("prefetch: %d message(s) per pool child, %d in all (was %d per child)",
                multiplier, count, before)
    return True
