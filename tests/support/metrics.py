"""The metric families the stack exports, for checks that documents name only real ones."""
from __future__ import annotations

import re

import requests

_SUFFIX = re.compile(r"_(bucket|count|sum)$")


def named_in(text: str) -> set[str]:
    """The metric families a query or command names (`iq_…`, histogram suffixes dropped)."""
    return {_SUFFIX.sub("", m) for m in re.findall(r"\biq_[a-z_]+", text)}


def exported(*urls: str) -> set[str]:
    """Families these /metrics endpoints export, plus the worker's declared ones: GPU gauges
    and OOM splits have no samples on a CPU-only host."""
    scraped = "".join(requests.get(url, timeout=5).text for url in urls)
    families = set(re.findall(r"^# TYPE (\w+) ", scraped, re.M))
    from workers import metrics as worker_metrics

    return families | worker_metrics.families()
