"""Webhooks: delivered by their own light queue, signed, retried, and never to private
addresses unless allow-listed (the tests allow 127.0.0.1 only)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from tasks.webhooks import sign
from tests.support.services import start_worker, wait_until
from tests.support.stack import launch

SECRET = "test-webhook-secret"


class Receiver:
    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.calls: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.calls.append({"headers": {k.lower(): v for k, v in self.headers.items()},
                                       "body": body})
                failing = len(receiver.calls) <= receiver.failures
                self.send_response(500 if failing else 204)
                self.end_headers()

            def log_message(self, *_args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("webhooks")
    models = {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}
    stack = launch(workdir, models, {"w": ["quick"]}, env_extra={
        "IQ_WEBHOOK_ALLOW": "127.0.0.1", "IQ_WEBHOOK_SECRET": SECRET,
        "IQ_WEBHOOK_BACKOFF_S": "0.2"})
    stack.workers["hooks"] = start_worker("hooks", stack.env, workdir, ["iq.webhooks"],
                                          concurrency=4, pool="threads")
    yield stack
    stack.stop()


def submit(stack, inputs, hook):
    r = requests.post(f"{stack.api}/v1/jobs", json={"model": "quick", "inputs": inputs,
                                                    "webhook": hook}, timeout=10)
    return r


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


@pytest.mark.parametrize("url", [
    "http://10.1.2.3/hook", "http://192.168.0.10/hook", "http://169.254.169.254/latest",
    "http://[::1]:8080/hook", "http://0.0.0.0/hook", "ftp://127.0.0.1/hook",
    "http://user:pw@127.0.0.1/hook", "not a url",
])
def test_private_loopback_and_link_local_targets_are_refused(hooked, url):
    r = submit(hooked, ["x"], {"url": url})
    assert r.status_code == 422
    assert any(k.startswith("webhook") for k in r.json()["error"]["fields"])
