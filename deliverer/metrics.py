"""The webhook deliverer's metrics in Prometheus format, served by the deliverer
(settings.webhook_metrics_port, default 9809, 0: off; on worker_metrics_host, as the worker's).

The deliverer is one process (a thread pool), so its metrics live in a registry of its own and
need no multiprocess files: every attempt by its outcome and how long it took, and the
deliveries given up after the last retry.
"""
from __future__ import annotations

import logging
from functools import lru_cache

from prometheus_client import CollectorRegistry, Counter, Histogram

from config import Settings

logger = logging.getLogger(__name__)

# An attempt is bounded by webhook_timeout_s (10 s by default).
ATTEMPT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class WebhookMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.attempts = Counter(
            "iq_webhook_attempts_total", "Delivery attempts by outcome (delivered, final, "
            "refused, busy: the host at its cap, retry)", ["outcome"], registry=self.registry)
        self.attempt_seconds = Histogram(
            "iq_webhook_attempt_seconds", "Time of one attempt that reached the receiver's "
            "host", buckets=ATTEMPT_BUCKETS, registry=self.registry)
        self.given_up = Counter("iq_webhook_given_up_total", "Deliveries given up after the "
                                "last retry", registry=self.registry)


@lru_cache(maxsize=1)
def get() -> WebhookMetrics:
    """This process's metrics, made on first use."""
    return WebhookMetrics()


def serve(settings: Settings) -> None:
    """In the deliverer, before it consumes: its metrics on settings.webhook_metrics_port, or
    the first free port after it (several deliverers on one host)."""
    from workers.metrics import serve_registry

    if settings.webhook_metrics_port > 0:
        serve_registry(get().registry, settings.webhook_metrics_port,
                       settings.worker_metrics_host, "webhook deliverer metrics")
