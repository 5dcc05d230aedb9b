"""Webhooks: who may be called, how a delivery is signed, and the delivery task's contract.

A job may ask for `"webhook": {"url", "events"}`. When it reaches one of those events the pool
child queues a delivery on the light `iq.webhooks` queue; a separate worker POSTs it with
retries and exponential backoff. Each request carries

    X-IQ-Event:      succeeded | failed
    X-IQ-Job-ID:     the job id
    X-IQ-Timestamp:  Unix seconds when it was signed
    X-IQ-Signature:  sha256=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>

so a receiver can check it came from this service and is fresh. URLs whose host resolves to
a private, loopback, link-local or otherwise non-public address are refused (at submit and
again before each delivery) unless the host is in IQ_WEBHOOK_ALLOW.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
import time
from urllib.parse import urlsplit

DELIVER_TASK = "iq.webhook.deliver"
QUEUE = "iq.webhooks"
EVENTS = ("succeeded", "failed")


class WebhookRefused(ValueError):
    """The URL may not be called; the message says why."""


def sign(secret: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def headers(secret: str, event: str, job_id: str, body: bytes) -> dict[str, str]:
    ts = int(time.time())
    return {"Content-Type": "application/json", "User-Agent": "inference-queue-webhook/1",
            "X-IQ-Event": event, "X-IQ-Job-ID": job_id, "X-IQ-Timestamp": str(ts),
            "X-IQ-Signature": sign(secret, ts, body)}


def _allowed(address: str, allow: list[str]) -> bool:
    ip = ipaddress.ip_address(address)
    for entry in allow:
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False


def check_url(url: str, allow: list[str]) -> None:
    """Raise WebhookRefused unless `url` is http(s) to public addresses or allow-listed ones."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookRefused("must be an http:// or https:// URL with a host")
    if parts.username or parts.password:
        raise WebhookRefused("must not carry credentials")
    host = parts.hostname
    if host in allow:
        return
    try:
        infos = socket.getaddrinfo(host, parts.port or (443 if parts.scheme == "https" else 80),
                                   proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        raise WebhookRefused(f"host {host!r} does not resolve") from None
    for info in infos:
        address = info[4][0].split("%", 1)[0]
        if _allowed(address, allow):
            continue
        ip = ipaddress.ip_address(address)
        if not ip.is_global or ip.is_multicast:
            raise WebhookRefused(f"host {host!r} resolves to a non-public address ({ip}); "
                                 "allow it with IQ_WEBHOOK_ALLOW")
