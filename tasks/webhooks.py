"""Webhooks: the delivery task's contract, how a delivery is signed, and when webhooks are on.

A job may ask for `"webhook": {"url", "events"}`. When it reaches one of those events the pool
child queues a delivery on the light `iq.webhooks` queue; the deliverer (workers.webhook_main)
POSTs it through tasks.egress, with retries and exponential backoff. Each request carries

    X-IQ-Event:      succeeded | failed
    X-IQ-Job-ID:     the job id
    X-IQ-Timestamp:  Unix seconds when it was signed
    X-IQ-Signature:  sha256=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>

so a receiver can check it came from this service and is fresh. Webhooks are off until
IQ_WEBHOOK_SECRET is set: a signature under a secret everyone knows proves nothing.
"""
from __future__ import annotations

import hashlib
import hmac
import time

DELIVER_TASK = "iq.webhook.deliver"
QUEUE = "iq.webhooks"
EVENTS = ("succeeded", "failed")
# The empty default, and the placeholder earlier versions shipped as the default.
_NOT_SECRETS = frozenset({"", "change-me"})
SECRET_MISSING = ("webhooks are off on this service: IQ_WEBHOOK_SECRET is not set (or is the "
                  "placeholder 'change-me'); set it to a random secret to turn them on")


def enabled(secret: str) -> bool:
    return secret.strip() not in _NOT_SECRETS


def sign(secret: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def headers(secret: str, event: str, job_id: str, body: bytes) -> dict[str, str]:
    ts = int(time.time())
    return {"Content-Type": "application/json", "User-Agent": "inference-queue-webhook/1",
            "X-IQ-Event": event, "X-IQ-Job-ID": job_id, "X-IQ-Timestamp": str(ts),
            "X-IQ-Signature": sign(secret, ts, body)}
