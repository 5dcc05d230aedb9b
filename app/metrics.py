"""Prometheus metrics for the API: requests by route and status, latency, jobs submitted and
rejected by model and reason, requests parked waiting, and, read from Redis at scrape time,
queue depth per model and the requests kept for retries (the dead-letter store).

Under gunicorn with several worker processes the counters and histograms are summed across
them (prometheus_client's multiprocess mode: gunicorn.conf.py sets PROMETHEUS_MULTIPROC_DIR to a
fresh folder unless one is given). What is read at scrape time (queue depths, the kept requests,
this process's parked waits) is read by the process that answers the scrape.
"""
from __future__ import annotations

import os
import time
from typing import Callable

from flask import Flask, Response, g, request
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram,
                               generate_latest, values)
from prometheus_client.core import GaugeMetricFamily

from config.process import pid

# Every label takes a value from a fixed set: a made-up method is "other", a path that matches
# no route is "unmatched", so that no client can grow the series.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class QueueDepthCollector:
    def __init__(self, depths: Callable[[], dict[str, int]]) -> None:
        self.depths = depths

    def collect(self):
        family = GaugeMetricFamily("iq_queue_depth", "Jobs waiting in a model's queue",
                                   labels=["model"])
        try:
            for model, depth in self.depths().items():
                family.add_metric([model], depth)
        except Exception:  # a scrape must not fail because Redis is down
            pass
        yield family


class KeptCollector:
    """What the requests kept for retries hold: jobs that did not succeed and kept theirs."""

    def __init__(self, kept: Callable[[], tuple[int, int]]) -> None:
        self.kept = kept

    def collect(self):
        jobs = GaugeMetricFamily("iq_kept_requests", "Requests of jobs that did not succeed, "
                                 "kept for a retry (kept_inputs_ttl_s)")
        size = GaugeMetricFamily("iq_kept_request_bytes", "Bytes those kept requests hold")
        try:
            count, total = self.kept()
            jobs.add_metric([], count)
            size.add_metric([], total)
        except Exception:  # a scrape must not fail because Redis is down
            pass
        yield jobs
        yield size


class WaitingCollector:
    def __init__(self, waiting: Callable[[], int], cap: int) -> None:
        self.waiting, self.cap = waiting, cap

    def collect(self):
        yield GaugeMetricFamily("iq_waiting_requests", "Requests of this process parked on "
                                "?wait or Prefer: wait", value=self.waiting())
        yield GaugeMetricFamily("iq_waiting_requests_max", "max_waits: the most this process "
                                "parks at once", value=self.cap)


def _pid_kept_in_process() -> None:
    """In multiprocess mode prometheus_client checks at each counter write whether the process
    has forked (its `process_identifier`, `os.getpid` by default: a system call, four a job).
    It is given config/process.py's pid instead, the same value, set anew in a forked child
    before any of its code runs. The metrics made after this (every one of ApiMetrics's: their
    labelled children are made at their first use) write through it; the files, their names
    and what a scrape reads are as before."""
    if getattr(values.ValueClass, "_multiprocess", False) and \
            getattr(values.ValueClass, "_iq_pid", None) is not pid:
        values.ValueClass = values.MultiProcessValue(process_identifier=pid)
        values.ValueClass._iq_pid = pid


class ApiMetrics:
    def __init__(self, depths: Callable[[], dict[str, int]], waiting: Callable[[], int],
                 max_waits: int, kept: Callable[[], tuple[int, int]]) -> None:
        _pid_kept_in_process()
        self.registry = CollectorRegistry()
        self.requests = Counter("iq_http_requests_total", "HTTP requests",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("iq_http_request_duration_seconds", "HTTP request latency",
                                 ["route", "method"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self.submitted = Counter("iq_jobs_submitted_total", "Jobs accepted", ["model"],
                                 registry=self.registry)
        self.rejected = Counter("iq_jobs_rejected_total", "Jobs refused", ["model", "reason"],
                                registry=self.registry)
        # Labelled children of the counters and the histogram, by their labels' values.
        self._children: dict = {}
        self.read_at_scrape = (QueueDepthCollector(depths), WaitingCollector(waiting, max_waits),
                               KeptCollector(kept))
        for collector in self.read_at_scrape:
            self.registry.register(collector)

    def init_app(self, app: Flask) -> None:
        app.before_request(self._start)
        app.after_request(self._observe)

    def _start(self) -> None:
        g.iq_started = time.perf_counter()

    def _observe(self, response):
        served = request._get_current_object()  # one look-up of the request, not three
        rule = served.url_rule
        route = rule.rule if rule else "unmatched"
        method = served.method if served.method in METHODS else "other"
        self._counted(route, method, response.status_code).inc()
        started = g.get("iq_started")
        if started is not None:
            self._timed(route, method).observe(time.perf_counter() - started)
        return response

    def _counted(self, route: str, method: str, status: int):
        """The request counter of a route, method and status, looked up by prometheus_client
        once (each `labels` call takes a lock and builds its key); the labels take values from
        fixed sets, so there are as many as routes x methods x statuses."""
        key = (route, method, status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.requests.labels(route, method, str(status))
        return child

    def _timed(self, route: str, method: str):
        key = (route, method)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.latency.labels(route, method)
        return child

    def submitted_job(self, model: str) -> None:
        """A job accepted for `model` (a model of the models file: a fixed set)."""
        child = self._children.get(model)
        if child is None:
            child = self._children[model] = self.submitted.labels(model)
        child.inc()

    def render(self) -> Response:
        registry = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            registry.register(_Summed(multiprocess.MultiProcessCollector(None),
                                      (self.requests, self.latency, self.submitted,
                                       self.rejected)))
            for collector in self.read_at_scrape:
                registry.register(collector)
        return Response(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


class _Summed:
    """The counters and histograms summed over every API process's files, and, as one process
    exports them, each family no process has counted in yet (its HELP and TYPE, no sample):
    the multiprocess files hold only what was counted, so `iq_jobs_rejected_total` would be
    missing from /metrics until the first refusal."""

    def __init__(self, summed, declared) -> None:
        self.summed, self.declared = summed, declared

    def collect(self):
        names = set()
        for family in self.summed.collect():
            names.add(family.name)
            yield family
        for metric in self.declared:
            for family in metric.describe():
                if family.name not in names:
                    yield family
