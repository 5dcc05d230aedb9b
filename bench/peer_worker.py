"""The peer: the same models behind celery-batches' `Batches` task, the library a Celery user
reaches for today. Same task names, queues, result format and child runtime as the service,
so the same HTTP API fronts it. Used by the benchmark only (celery-batches is not a runtime
dependency). Flush settings from BENCH_FLUSH_EVERY and BENCH_FLUSH_INTERVAL (seconds).

    celery -A bench.peer_worker worker -P prefork -c 1
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from celery import signals
from celery.utils.log import current_process_index
from celery_batches import Batches

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for spawned children

from tasks.celery_app import make_celery  # noqa: E402
from tasks.errors import JobFailed  # noqa: E402
from tasks.names import task_name  # noqa: E402
from workers.runtime import runtime, start_runtime, stop_runtime  # noqa: E402

FLUSH_EVERY = int(os.environ.get("BENCH_FLUSH_EVERY", "32"))
FLUSH_INTERVAL = float(os.environ.get("BENCH_FLUSH_INTERVAL", "0.005"))

celery = make_celery()
celery.conf.imports = ("bench.peer_worker",)


def _register(model: str) -> None:
    def infer(self, requests):
        jobs = [((r.kwargs or {}).get("inputs") or [], (r.kwargs or {}).get("options") or {})
                for r in requests]
        for r, result in zip(requests, runtime().run(model, jobs)):
            if isinstance(result, JobFailed):
                self.backend.mark_as_failure(r.id, result, request=r)
            else:
                self.backend.mark_as_done(r.id, {"outputs": result}, request=r)

    celery.task(name=task_name(model), base=Batches, bind=True, shared=False,
                flush_every=FLUSH_EVERY, flush_interval=FLUSH_INTERVAL)(infer)


for _model in celery.conf.iq_models:
    _register(_model)


@signals.worker_process_init.connect
def load_models(sender=None, **_kw) -> None:
    start_runtime(celery.conf.iq_settings, celery.conf.iq_models, sender or "peer",
                  current_process_index(base=0) or 0)


@signals.worker_process_shutdown.connect
def unload_models(**_kw) -> None:
    stop_runtime()
