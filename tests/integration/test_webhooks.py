"""Webhooks: delivered by their own light worker (workers.webhook_main), signed, retried, never
to private addresses unless allow-listed (the tests allow 127.0.0.1 and 127.0.0.2 only), and
off while no secret is set."""
from __future__ import annotations

import json
import uuid

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tasks.webhooks import sign
from tests.support.receivers import Receiver, Tarpit
from scripts.stack import launch, start_web, start_webhooks, wait_until

SECRET = "test-webhook-secret"
TIMEOUT_S = 20  # a whole delivery; the tarpit test needs it well above its own bound


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("webhooks")
    models = {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}
    stack = launch(workdir, models, {"w": ["quick"]}, env_extra={
        "IQ_WEBHOOK_ALLOW": "127.0.0.1,127.0.0.2", "IQ_WEBHOOK_SECRET": SECRET,
        "IQ_WEBHOOK_BACKOFF_S": "0.2", "IQ_WEBHOOK_RETRIES": "3",
        "IQ_WEBHOOK_TIMEOUT_S": str(TIMEOUT_S), "IQ_WEBHOOK_HOST_CONCURRENCY": "2"})
    hooks = stack.workers["hooks"] = start_webhooks("hooks", stack.env, workdir, concurrency=4)
    # Up before any test reads its metrics (a test may be the first of this module to run).
    wait_until(lambda: requests.get(hooks.extra["metrics_url"], timeout=2).ok, 60,
               "the webhook deliverer's metrics")
    yield stack
    stack.stop()


def submit(stack, inputs, hook):
    return requests.post(f"{stack.api}/v1/jobs", json={"model": "quick", "inputs": inputs,
                                                       "webhook": hook}, timeout=10)


def deliverer_log(stack) -> str:
    return stack.workers["hooks"].log.read_text(errors="replace")


def test_a_signed_webhook_is_delivered_when_the_job_succeeds(hooked):
    receiver = Receiver()
    try:
        job = submit(hooked, ["hello"], {"url": receiver.url}).json()
        assert hooked.finished(job["id"])["status"] == "succeeded"
        wait_until(lambda: receiver.calls, 30, "the webhook")
        call = receiver.calls[0]
        headers = call["headers"]
        assert headers["x-iq-event"] == "succeeded" and headers["x-iq-job-id"] == job["id"]
        assert headers["x-iq-signature"] == sign(SECRET, int(headers["x-iq-timestamp"]),
                                                 call["body"])
        payload = json.loads(call["body"])
        assert payload["status"] == "succeeded" and payload["result"] == {"outputs": [5]}
    finally:
        receiver.close()


def test_a_failing_receiver_is_retried_with_backoff(hooked):
    receiver = Receiver(failures=2)
    try:
        job = submit(hooked, ["!fail"], {"url": receiver.url, "events": ["failed"]}).json()
        assert hooked.finished(job["id"])["status"] == "failed"
        wait_until(lambda: len(receiver.calls) >= 3, 60, "two retries and a delivery")
        assert len(receiver.calls) == 3
        payload = json.loads(receiver.calls[-1]["body"])
        assert payload["status"] == "failed" and payload["error"]["code"] == "inference_error"
    finally:
        receiver.close()


def test_events_not_asked_for_are_not_sent(hooked):
    receiver = Receiver()
    try:
        job = submit(hooked, ["ok"], {"url": receiver.url, "events": ["failed"]}).json()
        assert hooked.finished(job["id"])["status"] == "succeeded"
        marker = submit(hooked, ["!fail"], {"url": receiver.url, "events": ["failed"]}).json()
        wait_until(lambda: receiver.calls, 30, "the later job's webhook")
        # Deliveries are queued in job order; only the failed job's one arrived.
        assert [c["headers"]["x-iq-job-id"] for c in receiver.calls] == [marker["id"]]
    finally:
        receiver.close()


def test_a_redirect_is_a_final_answer(hooked):
    receiver = Receiver(status=302)
    try:
        job = submit(hooked, ["moved"], {"url": receiver.url}).json()
        line = f"webhook for job {job['id']}: 127.0.0.1 answered 302; not retried"
        wait_until(lambda: line in deliverer_log(hooked), 30, "the 302 to be taken as final")
        assert len(receiver.calls) == 1
    finally:
        receiver.close()


def deliverer_metrics(stack) -> dict[tuple[str, tuple], float]:
    """The deliverer's samples, by name and labels, from its own metrics endpoint."""
    text = requests.get(stack.workers["hooks"].extra["metrics_url"], timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_exhausted_retries_log_job_host_and_status_never_payload_or_url(hooked):
    receiver = Receiver(status=500)
    token = uuid.uuid4().hex
    retried, given_up = ("iq_webhook_attempts_total", (("outcome", "retry"),)), \
        ("iq_webhook_given_up_total", ())
    before = deliverer_metrics(hooked)
    try:
        job = submit(hooked, ["hello"], {"url": f"{receiver.url}/{token}?sig={token}"}).json()
        line = f"webhook for job {job['id']} to 127.0.0.1 given up after 4 attempts; last: 500"
        wait_until(lambda: line in deliverer_log(hooked), 60, "the retries to run out")
        assert len(receiver.calls) == 4  # the first attempt and IQ_WEBHOOK_RETRIES more
        after = deliverer_metrics(hooked)  # counted before the line is logged
        assert after[retried] - before.get(retried, 0) >= 4
        assert after[given_up] - before.get(given_up, 0) >= 1
        assert after[("iq_webhook_attempt_seconds_count", ())] >= 4
        logs = "".join(p.read_text(errors="replace") for p in hooked.workdir.glob("*.log"))
        assert token not in logs
        assert "'outputs'" not in logs and '"outputs"' not in logs  # the payload's result
    finally:
        receiver.close()


def test_a_tarpit_receiver_does_not_hold_up_other_receivers(hooked):
    """8 deliveries to a receiver that answers one byte every 2 s, then one to a normal
    receiver: the tarpit holds its per-host share of the deliverer's 4 threads (2) until the
    delivery deadline, and the normal one is delivered meanwhile."""
    tarpit, receiver = Tarpit(interval=2.0, host="127.0.0.2"), Receiver()
    try:
        for i in range(8):
            assert submit(hooked, [f"slow {i}"], {"url": tarpit.url}).status_code == 202
        wait_until(lambda: tarpit.accepted >= 2, 30, "the tarpit's first deliveries")
        job = submit(hooked, ["quick"], {"url": receiver.url}).json()
        # Generous: a free thread delivers in well under a second; a held one would wait
        # for the tarpit's deadline (TIMEOUT_S).
        wait_until(lambda: receiver.calls, TIMEOUT_S * 0.75, "the normal receiver's webhook")
        assert receiver.calls[0]["headers"]["x-iq-job-id"] == job["id"]
        # Meanwhile the tarpit never held more than its cap, and nothing of it finished.
        assert tarpit.most_open == 2 and tarpit.accepted == 2 and tarpit.ended == 0
    finally:
        tarpit.close()
        receiver.close()


@pytest.mark.parametrize("url", [
    "http://10.1.2.3/hook", "http://192.168.0.10/hook", "http://169.254.169.254/latest",
    "http://[::1]:8080/hook", "http://0.0.0.0/hook", "ftp://127.0.0.1/hook",
    "http://user:pw@127.0.0.1/hook", "not a url", "http://127.0.0.1:99999/hook",
])
def test_private_loopback_link_local_and_malformed_targets_are_refused(hooked, url):
    r = submit(hooked, ["x"], {"url": url})
    assert r.status_code == 422, r.text
    messages = r.json()["error"]["fields"]["webhook.url"]
    assert not any("10.1.2.3" in m or "::1" in m for m in messages)  # no DNS oracle


def test_webhooks_are_refused_while_no_secret_is_set(hooked):
    env = {k: v for k, v in hooked.env.items() if k != "IQ_WEBHOOK_SECRET"}
    web = start_web(env, hooked.workdir)
    try:
        r = requests.post(f"{web.extra['url']}/v1/jobs", timeout=10, json={
            "model": "quick", "inputs": ["x"], "webhook": {"url": "http://127.0.0.1:9/hook"}})
        assert r.status_code == 422, r.text
        assert "IQ_WEBHOOK_SECRET" in r.json()["error"]["fields"]["webhook"][0]
        r = requests.post(f"{web.extra['url']}/v1/jobs", timeout=10,
                          json={"model": "quick", "inputs": ["x"]})
        assert r.status_code == 202  # only webhooks are off
    finally:
        web.stop()


def test_the_deliverer_will_not_start_with_the_placeholder_secret(hooked, tmp_path):
    env = dict(hooked.env, IQ_WEBHOOK_SECRET="change-me")
    deliverer = start_webhooks("placeholder", env, tmp_path)
    try:
        assert deliverer.proc.wait(60) != 0
        assert "IQ_WEBHOOK_SECRET" in deliverer.log.read_text()
    finally:
        deliverer.stop()
