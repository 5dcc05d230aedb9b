"""The peer: the same models behind celery-batches' `Batches` task, the library a Celery user
reaches for today. Same task names, queues, job state, result format and child runtime as the service,
so the same HTTP API fronts it. Used by the benchmark only (celery-batches is not a runtime
dependency). Flush settings from BENCH_FLUSH_EVERY and BENCH_FLUSH_INTERVAL (seconds).

    celery -A bench.peer_worker worker -P prefork -c 1
"""
from __future__ import annotations

import os
import time

from celery import bootsteps, signals
from celery.utils.log import current_process_index
from celery_batches import Batches

from tasks.celery_app import make_celery
from tasks.keys import CONSUMING_KEY, consuming_key
from tasks.names import task_name
from tasks.redis_client import connect
from workers import broker
from workers.child.batch import BatchJob
from workers.child.execute import run_batch
from workers.child.runtime import start_runtime, stop_runtime
from workers.spawn import project_on_path

FLUSH_EVERY = int(os.environ.get("BENCH_FLUSH_EVERY", "32"))
FLUSH_INTERVAL = float(os.environ.get("BENCH_FLUSH_INTERVAL", "0.005"))

project_on_path()  # for the spawned pool children
celery = make_celery()
broker.attach(celery)  # the service's transport, consumer and pool: only the batching differs
celery.conf.imports = ("bench.peer_worker",)


def _register(model: str) -> None:
    def infer(self, requests):
        # The service's own batch executor: the same job state moves and result writes, so
        # that only the batching in the worker's main process differs. Each job as the
        # service's parent builds it (BatchJob.of), from the headers celery-batches keeps in
        # `request_dict`: its job_token above all, without which `start` takes the message
        # for one sent by hand and drops it (the job would never finish).
        run_batch(model, [BatchJob.of(r) for r in requests])

    celery.task(name=task_name(model), base=Batches, bind=True, shared=False,
                flush_every=FLUSH_EVERY, flush_interval=FLUSH_INTERVAL)(infer)


for _model in celery.conf.iq_models:
    _register(_model)


class Consuming(bootsteps.StartStopStep):
    """What the service's liveness tick tells /readyz (tasks/keys.py CONSUMING_KEY and
    consuming_key): this worker's event loop turns while it is connected, and which queues it
    consumes."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c) -> None:
        settings = c.app.conf.iq_settings
        client = connect(settings.redis_url, settings)

        def announce() -> None:
            now = time.time()
            with client.pipeline(transaction=False) as pipe:
                pipe.zadd(CONSUMING_KEY, {c.hostname: now})
                for queue in c.task_consumer.queues:
                    pipe.zadd(consuming_key(queue.name), {c.hostname: now})
                pipe.execute()

        self.tref = c.timer.call_repeatedly(settings.heartbeat_interval_s, announce)

    def stop(self, c) -> None:
        self.tref.cancel()


celery.steps["consumer"].add(Consuming)


@signals.worker_process_init.connect
def load_models(sender=None, **_kw) -> None:
    start_runtime(celery, sender or "peer", current_process_index(base=0) or 0)


@signals.worker_process_shutdown.connect
def unload_models(**_kw) -> None:
    stop_runtime()
