"""Webhooks: the delivery task's contract, how a delivery is signed, and when webhooks are on.

A job may ask for `"webhook": {"url", "events"}`. The URL is kept in the job's record, never in
a task message. When the job reaches one of its events the pool child queues a delivery on the
light `iq.webhooks` queue whose arguments are the job id and the event only; the deliverer
(deliverer.main) reads the URL, the job's owner and its result from Redis, and POSTs
through tasks.egress, with retries and exponential backoff. Flower, `celery inspect` and the
retries' task arguments show neither the URL (which may carry a receiver's token) nor the
payload.

Deliveries are signed as Standard Webhooks (https://www.standardwebhooks.com) specifies:

    webhook-id:         the delivery's id: the same on every retry of one delivery
    webhook-timestamp:  Unix seconds when this attempt was signed
    webhook-signature:  v1,<base64 HMAC-SHA256(key, "<id>.<timestamp>.<body>")>

The body holds the job's id and its `status`, the event: the signature covers the delivery
id, the timestamp, the event and the body. The key is a tenant's own: with API keys, each
key's jobs are signed with a key derived from IQ_WEBHOOK_SECRET and the API key's name, so that
one tenant's receiver cannot forge deliveries to another's; without keys, a key derived the
same way under a label of its own, so that a receiver set up before keys were turned on does
not hold IQ_WEBHOOK_SECRET (from which, names not being secret, every tenant's key follows).
`python -m tasks.webhooks secret [KEY_NAME]` prints the receiver's secret in the
Standard Webhooks form (`whsec_` + base64 of the key). Webhooks are off until
IQ_WEBHOOK_SECRET is set: a signature under a secret everyone knows proves nothing.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import sys
import time

DELIVER_TASK = "iq.webhook.deliver"
QUEUE = "iq.webhooks"
# Deliveries whose attempts are spent, newest first (JSON: delivery, job_id, event, host,
# attempts, last answer, at), the last DEAD_LETTER_CAP of them.
DEAD_LETTERS = "iq:webhooks:dead"
DEAD_LETTER_CAP = 10_000
EVENTS = ("succeeded", "failed")
# The empty default, and the placeholder earlier versions shipped as the default.
_NOT_SECRETS = frozenset({"", "change-me"})
SECRET_MISSING = ("webhooks are off on this service: IQ_WEBHOOK_SECRET is not set (or is the "
                  "placeholder 'change-me'); set it to a random secret to turn them on")
_TENANT_LABEL = b"inference-queue webhook key for API key "
_KEYLESS_LABEL = b"inference-queue webhook key without API keys"


def enabled(secret: str) -> bool:
    return secret.strip() not in _NOT_SECRETS


def accepted(secret: str, told_enabled: bool) -> bool:
    """Whether the API takes jobs with a webhook: it holds the secret, or is told (by
    IQ_WEBHOOKS_ENABLED) that the deliverer does."""
    return told_enabled or enabled(secret)


def signing_key(secret: str, owner: str) -> bytes:
    """The key deliveries of `owner`'s jobs (an API key's name; "" with keys off) are
    signed with: never the secret itself."""
    label = _TENANT_LABEL + owner.encode() if owner else _KEYLESS_LABEL
    return hmac.new(secret.encode(), label, hashlib.sha256).digest()


def receiver_secret(secret: str, owner: str) -> str:
    """The secret a receiver checks `owner`'s deliveries with, as Standard Webhooks writes
    one."""
    return "whsec_" + base64.b64encode(signing_key(secret, owner)).decode()


def sign(key: bytes, delivery_id: str, timestamp: int, body: bytes) -> str:
    content = f"{delivery_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, content, hashlib.sha256).digest()).decode()


def headers(key: bytes, delivery_id: str, body: bytes) -> dict[str, str]:
    ts = int(time.time())
    return {"Content-Type": "application/json", "User-Agent": "inference-queue-webhook/2",
            "webhook-id": delivery_id, "webhook-timestamp": str(ts),
            "webhook-signature": sign(key, delivery_id, ts, body)}


def main(argv: list[str]) -> int:
    """`python -m tasks.webhooks secret [KEY_NAME]`: a receiver's secret, from the
    IQ_WEBHOOK_SECRET of the environment (or IQ_CONFIG)."""
    from config import load_settings

    if len(argv) not in (2, 3) or argv[1] != "secret":
        print("usage: python -m tasks.webhooks secret [API_KEY_NAME]", file=sys.stderr)
        return 2
    secret = load_settings().webhook_secret
    if not enabled(secret):
        print(SECRET_MISSING, file=sys.stderr)
        return 1
    print(receiver_secret(secret, argv[2] if len(argv) == 3 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
