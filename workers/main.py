"""Worker entry module: `celery -A workers.main worker -P prefork -Q <model queues>`.

It wires things together: the Celery app with one batching task per model, the worker's
kombu transport, consumer and pool (workers.broker), the dispatcher's consumer bootstep, logging,
metrics and the pool children's model runtime. The parent process buffers and batches
(workers.batching.strategy → workers.batching.dispatcher); each pool child, started with the
spawn method, loads the models of the queues this worker consumes (workers.child.runtime) and
runs batches (workers.child.execute). Neither this module nor the parent imports torch.
"""
from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from celery import signals
from celery.utils.log import current_process_index

from tasks import logs, reload_failures, tracing
from tasks.heap import freeze_start_up
from config import load_settings, start_unless_metrics_folder_fails
from config.models import parse_models, read_models_content, revision_of
from tasks.celery_app import make_celery
from workers.child.pinned import pin, pinned, reload_from
from workers import broker, metrics
from workers.child import load_failure
from workers.child.devices import visible_gpu_count
from workers.child.runtime import start_runtime, stop_runtime
from workers.spawn import make_own_folder, project_on_path
from workers.batching import prefetch
from workers.batching.model_tasks import register_model
from workers.batching.stopping import LAST_RESORT_S, exit_within, hold_stops_for_the_main_process
from workers.batching.strategy import DispatcherStep

logger = logging.getLogger(__name__)

project_on_path()  # for the spawned pool children

_settings = load_settings()
_pinned = pinned(_settings.models_file)  # a pool child: its main process's models file
_reload_from = reload_from()  # a reload's child: the revision its worker served before
_gpus = 0  # a child: its prefetch is not its own; its batch is sized by its device
if _pinned is None:  # the main process: the file on disk, pinned for its children
    start_unless_metrics_folder_fails("the worker")  # before its children write metrics
    _content = read_models_content(_settings.models_file)
    _pinned = parse_models(Path(_settings.models_file), _content), revision_of(_content)
    pin(_content)
    _gpus = visible_gpu_count(_settings)  # its prefetch holds the calibrated batches
celery = make_celery(_settings, *_pinned, gpus=_gpus)
broker.attach(celery)
# Spawned pool children import this module too, which connects the signal handlers below.
celery.conf.imports = ("workers.main",)
celery.steps["consumer"].add(DispatcherStep)


for _model in celery.conf.iq_models:
    register_model(celery, _model)
logs.configure_celery(celery.conf.iq_settings.log_format)


@signals.celeryd_after_setup.connect
def select_models(sender: str, instance, conf, **_kw) -> None:
    """Children load the models whose queues this worker consumes (all of them by default),
    and its prefetch is sized by them."""
    queues = set(instance.app.amqp.queues.consume_from or {})
    specs = conf.iq_models
    models = [m for m, s in specs.items() if not queues or s.queue in queues]
    # Its prefetch: two full batches per child of the largest of them (each on a GPU the
    # calibrator's), set before its consumer connects (workers/batching/prefetch.py).
    prefetch.fit_served(instance.consumer, conf.iq_settings, [specs[m] for m in models], _gpus)
    # The children read it as their settings.worker_models (IQ_WORKER_MODELS): they are
    # spawned, so the environment is what they inherit.
    os.environ["IQ_WORKER_MODELS"] = ",".join(models)
    # A worker that consumes every model's queue (the default, without -Q) consumes the queue
    # of a model that a reload adds, too.
    conf.iq_consumes_all = queues >= {s.queue for s in specs.values()}
    logger.info("worker %s serves models: %s", sender, ", ".join(models) or "(none)")
    # Its children's metrics, why one could not load, the stand-in's locks: workers/spawn.py.
    conf.iq_metrics_address = metrics.serve(conf.iq_settings, make_own_folder())


@signals.worker_ready.connect
def set_start_up_aside(sender=None, **_kw) -> None:
    """The main process serves: its start-up objects are frozen out of the garbage
    collector's full collections (tasks/heap.py), which otherwise walk them all every few
    thousand jobs, the event loop stopped meanwhile."""
    freeze_start_up()


@signals.worker_process_init.connect
def load_models(sender: str | None = None, **_kw) -> None:
    tracing.setup("inference-queue-worker")  # in the child: its exporter thread is its own
    index = current_process_index(base=0) or 0
    try:
        start_runtime(celery, sender or "worker", index)
    except BaseException as exc:
        # Whatever happens here (an error whose message cannot be made, Redis away), the
        # child exits: kept, it would take jobs it cannot run.
        stop_the_worker = True
        try:
            if _reload_from and reload_failures.record(celery.conf.iq_settings, _pinned[1],
                                                   sender or "worker", exc):
                # A reload's new models: this child exits, and its worker keeps serving the
                # models it had, rolling the reload back (workers/batching/reload.py).
                stop_the_worker = False
                logger.error("pool child %d could not load models file revision %s (a "
                             "reload's): recorded; this worker rolls back to revision %s",
                             index, _pinned[1], _reload_from, exc_info=True)
            else:
                # Celery would only log this and keep a child that cannot run a batch: every
                # job handed to it would fail, though none is at fault; and a child that
                # merely exits is started again, and fails again, for ever. So the whole
                # worker stops (a warm shutdown of its main process: what it holds goes back
                # to the queues), loudly, and the jobs wait for a worker that can run them.
                logger.critical("pool child %d could not load its models; this worker stops",
                                index, exc_info=True)
                load_failure.record(f"pool child {index} could not load its models: "
                                    f"{reload_failures.one_line(exc, whole=True, most=350)}")
        finally:
            logging.shutdown()
            if stop_the_worker:
                os.kill(os.getppid(), signal.SIGTERM)
            os._exit(1)
    # From its first batch on, a SIGTERM to the worker's whole group (make run's stop) leaves
    # the child's batch to the main process's warm shutdown (workers/batching/stopping.py).
    hold_stops_for_the_main_process()
    # Its models loaded (torch and the model: ~160,000 objects), a full collection would stop
    # the model for ~150 ms every few thousand jobs; frozen, they are not walked.
    freeze_start_up()


@signals.worker_process_shutdown.connect
def unload_models(pid: int | None = None, **_kw) -> None:
    stop_runtime()
    tracing.shutdown()
    metrics.child_exited(pid or os.getpid())


@signals.worker_shutdown.connect
def failed_exit(sender, **_kw) -> None:
    """A stop a pool child asked for, as it could not load its models: the worker exits
    with status 1, its reason in one line (workers/child/load_failure.py), not 0."""
    why = load_failure.reason()
    if why and hasattr(sender, "exitcode"):
        sender.exitcode = 1
        logger.critical("worker stopped, exit status 1: %s", why)


@signals.worker_shutting_down.connect
def bounded_stop(sender: str, **_kw) -> None:
    """A stop's last resort (workers/batching/stopping.py): a worker whose consumer never reaches
    its close, so never arms its StopDeadline (its Redis frozen: each call waits out its socket
    timeout), exits stop_timeout_s + LAST_RESORT_S into its stop, before make run kills it."""
    exit_within(celery.conf.iq_settings.stop_timeout_s + LAST_RESORT_S, "the worker")
