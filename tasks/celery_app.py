"""The Celery app factory shared by the API (which only sends), Flower, the celery CLI and the
workers. It only configures: the worker's own kombu transport, consumer and pool are the worker
entry modules' to select (workers/broker/)."""
from __future__ import annotations

from typing import Any, Iterable
from urllib.parse import parse_qs, urlsplit

from celery import Celery
from kombu import Connection, Queue

from config import Settings, load_settings
from config.calibration import effective_batch_size, on_gpu
from config.groups import check_model_groups
from config.models import ModelSpec, read_models
from tasks import results
from tasks.names import PRIORITIES, PRIORITY_SEP, PRIORITY_STEPS, task_routes
from tasks.redis_client import sentinel_options
from tasks.webhooks import DELIVER_TASK
from tasks.webhooks import QUEUE as WEBHOOK_QUEUE


def make_celery(settings: Settings | None = None,
                models: dict[str, ModelSpec] | None = None, revision: str = "",
                gpus: int = 0, *, kinds: bool = True) -> Celery:
    """The Celery app. The API only builds task messages with it (tasks/jobstate.py queues
    them) and broadcasts revokes; the workers run it. `models`: the parsed models file, when
    the caller has it already, and `revision` that file's (config.models.revision_of);
    `gpus`: the worker's GPUs, on which a model's batch is the calibrator's answer
    (config/calibration.py), which sizes the worker's prefetch. `kinds=False`: the models
    file's `kinds:` modules are not imported (the deliverer, Flower and the celery CLI, which
    route by name and queue and never serve nor describe a model: config.models.parse_models)."""
    settings = settings or load_settings()
    if models is None:
        models, revision = read_models(settings.models_file, kinds=kinds)
    # A model naming a Redis group the settings do not configure stops the process here.
    check_model_groups(models, settings.redis_group_urls)
    results.register_serializer()
    app = Celery("inference_queue", set_as_current=False)
    app.conf.update(
        task_serializer="json",
        # Stored results: JSON, or an embedding's packed float32 values (tasks/results.py).
        result_serializer=results.SERIALIZER,
        result_accept_content=["json", results.SERIALIZER],
        accept_content=["json"],
        task_routes={**task_routes(models.values()), DELIVER_TASK: {"queue": WEBHOOK_QUEUE}},
        # A worker started without -Q consumes every model's queue.
        task_queues=[Queue(m.queue) for m in models.values()],
        task_default_priority=PRIORITIES["normal"],
        result_expires=settings.job_ttl_s,
        worker_hijack_root_logger=False,
        **_redis_conf(settings),
        **_worker_conf(settings, models, gpus),
    )
    if settings.redis_url.startswith("rediss://"):
        # kombu reads a rediss:// URL's TLS options (ssl_cert_reqs, ssl_ca_certs) from its
        # query; Flower's Broker tab reads them only from broker_use_ssl.
        app.conf.broker_use_ssl = Connection(settings.redis_url).ssl
        if settings.sentinel_hosts:  # the sentinel:// URLs carry no TLS options
            app.conf.redis_backend_use_ssl = app.conf.broker_use_ssl
    app.conf.iq_settings = settings
    app.conf.iq_models = models
    app.conf.iq_models_revision = revision
    return app


def _redis_conf(settings: Settings) -> dict[str, Any]:
    """Redis as broker and result backend: timeouts, retries, and how a dead worker's
    messages come back."""
    redis_opts = {
        "socket_connect_timeout": settings.redis_timeout_s,
        "socket_timeout": max(settings.redis_timeout_s, 5.0),
        "retry_on_timeout": True,
    }
    if settings.sentinel_hosts:
        # kombu's Sentinel transport and Celery's Sentinel backend: each asks the sentinels
        # for the primary when it connects, so each follows a failover.
        redis_opts.update(master_name=settings.redis_master, sentinel_kwargs=sentinel_options(
            settings, max(settings.redis_timeout_s, 5.0)))
    url = sentinel_url(settings)
    return dict(
        broker_url=url,
        # Celery's Redis (or Sentinel) backend, which reads a packed result's task id from
        # its key.
        result_backend=results.backend_url(url),
        # Every gunicorn thread may publish at once; a smaller pool makes them queue for it.
        broker_pool_limit=128,
        broker_connection_timeout=settings.redis_timeout_s,
        broker_connection_retry_on_startup=True,
        # A worker never gives up on Redis: it reconnects however long the outage lasts.
        broker_connection_max_retries=None,
        # A Redis error on the consumer's connection (a full Redis refusing a write, say) is
        # reconnected from, like a dropped connection; by default it kills the worker.
        broker_channel_error_retry=True,
        broker_transport_options={
            # Messages whose lease (workers/broker/leases.py) has not been renewed for this
            # long belong to a dead worker: any live worker's sweep, every few seconds
            # (kombu's default is every 100 s), puts them back on their queues.
            "visibility_timeout": settings.visibility_timeout_s,
            "unacked_restore_interval": max(1, min(5, settings.visibility_timeout_s // 6)),
            "unacked_restore_throttle": 1,
            # A worker killed during a sweep leaves its mutex behind; kombu's 300 s would
            # stop every sweep for five minutes.
            "unacked_mutex_expire": max(5, settings.visibility_timeout_s // 2),
            # A half-open BRPOP or pub/sub connection is dropped after brpop_timeout + 2 x
            # this (kombu's default of 25 s makes it ~51 s).
            "health_check_interval": 10,
            "priority_steps": PRIORITY_STEPS,
            "sep": PRIORITY_SEP,
            "queue_order_strategy": "priority",
            **redis_opts,
        },
        result_backend_transport_options=redis_opts,
        redis_socket_connect_timeout=settings.redis_timeout_s,
        redis_socket_timeout=max(settings.redis_timeout_s, 5.0),
        # The API must answer 503 within seconds when Redis is down, not retry for long.
        task_publish_retry_policy={
            "max_retries": 2,
            "interval_start": 0,
            "interval_step": 0.2,
            "interval_max": 0.5,
        },
    )


def sentinel_url(settings: Settings) -> str:
    """REDIS_URL, or with Sentinel the URL kombu and Celery take for it: each sentinel as
    `sentinel://user:password@host:port/db`, `;`-separated (REDIS_URL's credentials and
    database: those of the primary); a Unix socket's as kombu spells it (`socket_url`)."""
    if not settings.sentinel_hosts:
        return socket_url(settings.redis_url)
    parts = urlsplit(settings.redis_url)
    auth = parts.netloc.rpartition("@")[0]
    auth = f"{auth}@" if auth else ""
    db = parts.path if parts.path not in ("", "/") else "/0"
    return ";".join(f"sentinel://{auth}{f'[{host}]' if ':' in host else host}:{port}{db}"
                    for host, port in settings.sentinel_hosts)


def socket_url(url: str) -> str:
    """A Unix socket's URL as redis-py spells it (`unix://[user:password@]/path/redis.sock
    [?db=N]`) in kombu's and Celery's spelling (`redis+socket://[user:password@]/path/
    redis.sock?virtual_host=N`); any other URL as it is."""
    parts = urlsplit(url)
    if parts.scheme != "unix":
        return url
    db = parse_qs(parts.query).get("db", ["0"])[0]
    return f"redis+socket://{parts.netloc}{parts.path}?virtual_host={db}"


def prefetch_multiplier(settings: Settings, batches: Iterable[int]) -> int:
    """Messages a worker holds unacknowledged per pool child: IQ_PREFETCH_MULTIPLIER when
    set, else two full batches of the largest of `batches` (the max batches of the models it
    serves, each on a GPU the calibrator's: config/calibration.py `effective_batch_size`),
    enough to fill a batch while every child is busy. No model: two messages."""
    return settings.prefetch_multiplier or 2 * max(batches, default=1)


def _worker_conf(settings: Settings, models: dict[str, ModelSpec],
                 gpus: int) -> dict[str, Any]:
    """How a worker takes, holds and acknowledges its jobs."""
    return dict(
        # Nothing is acknowledged before its result is stored; a lost pool child's jobs are
        # put back on the queue at once rather than failed.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # The batching strategy needs enough unacknowledged messages in hand to fill a batch
        # while every child is busy: two full batches per child, here of the largest model
        # in the file (a worker consuming every queue). A worker narrows it to the models it
        # serves once it knows its queues, and follows a reload or a queue added or
        # cancelled (workers/batching/prefetch.py): one started with -Q for a small model
        # would otherwise hoard the jobs another worker could run.
        worker_prefetch_multiplier=prefetch_multiplier(
            settings, (effective_batch_size(m, settings, on_gpu(m, gpus))
                       for m in models.values())),
        worker_pool_start_method="spawn",
        worker_proc_alive_timeout=settings.proc_alive_timeout_s,
        worker_lost_wait=settings.worker_lost_wait_s,
        # Each job's own events (received, started, succeeded/failed) for Flower. The API's
        # task-sent event is left off: it would cost a publish per job on the submit path.
        worker_send_task_events=True,
        # Celery lowers the prefetch count after a reconnect and raises it again through its
        # own ack callbacks; the dispatcher acknowledges by delivery tag itself
        # (workers/broker/leases.py), so the count would stay low. The dispatcher's buffer is
        # what bounds the worker anyway.
        worker_enable_prefetch_count_reduction=False,
        # Never kill a running batch because the connection dropped: its leases are renewed
        # and its results stored without that connection.
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
