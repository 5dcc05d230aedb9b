"""Webhook retries that wait longer than the visibility timeout, on the default settings
(IQ_WEBHOOK_BACKOFF_S 2: the fifth retry waits 32 s, past the 30 s lease). Each receiver answers
500 five times, then 204; two deliverers run, so a recovery that copied a waiting retry would
deliver it twice. Each job's webhook is attempted exactly six times, under one delivery id,
and delivered once. (Celery countdowns held unacknowledged were swept back and ran as extra
copies: 11-15 attempts where 9 were due, 3-6 deliveries once the receiver was back.)"""
from __future__ import annotations

import pytest

from scripts.stack import launch, start_webhooks, wait_until
from tasks.keys import delayed_key
from tasks.webhooks import QUEUE
from tests.faults.test_recovery import held_by_workers
from tests.support.receivers import Receiver

pytestmark = pytest.mark.slow

FAILURES = 5  # retries 1-5 wait 2, 4, 8, 16 and 32 s: the last outlasts a lease
JOBS = 6


def test_webhook_retries_past_the_visibility_timeout_are_delivered_once(tmp_path):
    models = {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}
    stack = launch(tmp_path, models, {"w": ["quick"]}, defaults=True,
                   env_extra={"IQ_WEBHOOK_ALLOW": "127.0.0.1"})
    receivers = [Receiver(failures=FAILURES) for _ in range(JOBS)]
    try:
        for name in ("d1", "d2"):
            stack.workers[name] = start_webhooks(name, stack.env, tmp_path)
        jobs = [stack.submit("quick", [f"hooked-{i}"], webhook={"url": r.url})["id"]
                for i, r in enumerate(receivers)]
        assert {stack.finished(j)["status"] for j in jobs} == {"succeeded"}
        wait_until(lambda: all(len(r.calls) > FAILURES for r in receivers), 150,
                   "every webhook delivered after its failures")
        # Nothing left to deliver: no retry waits, no deliverer holds one.
        wait_until(lambda: stack.redis.zcard(delayed_key(QUEUE)) == 0
                   and held_by_workers(stack) == 0, 30, "every delivery settled")
        for job_id, receiver in zip(jobs, receivers):
            assert len(receiver.calls) == FAILURES + 1, (job_id, len(receiver.calls))
            assert len({c["headers"]["webhook-id"] for c in receiver.calls}) == 1
        print(f"{JOBS} webhooks: {[len(r.calls) for r in receivers]} attempts, one delivery "
              "each")
    except BaseException:
        print(stack.logs())
        raise
    finally:
        for receiver in receivers:
            receiver.close()
        stack.stop()
