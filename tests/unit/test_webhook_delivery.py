"""One delivery attempt (deliverer.webhooks.attempt) against real local receivers, without a
broker: what each answer means, the per-host cap, and how it is signed."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time

import pytest

from config import load_settings
from tasks.webhooks import headers as signed_headers, receiver_secret, signing_key
from tests.support.receivers import Receiver, readme_receiver
from deliverer.webhooks import Delivery, HostSlots, Outcome, attempt

SETTINGS = load_settings({"webhook_secret": "s3cret", "webhook_allow": "127.0.0.1",
                          "webhook_timeout_s": 10}, environ={})


def to(url: str, owner: str = "") -> Delivery:
    return Delivery("msg_1", url, owner, {"id": "job-1", "status": "succeeded"})


@pytest.mark.parametrize("status, outcome", [
    (200, Outcome.DELIVERED), (204, Outcome.DELIVERED), (301, Outcome.FINAL),
    (302, Outcome.FINAL), (404, Outcome.FINAL), (408, Outcome.RETRY), (429, Outcome.RETRY),
    (500, Outcome.RETRY), (503, Outcome.RETRY),
])
def test_each_answer_is_delivered_final_or_retried(status, outcome):
    receiver = Receiver(status=status)
    try:
        result = attempt(to(receiver.url), SETTINGS, HostSlots(2))
        assert (result.outcome, result.status) == (outcome, status)
        assert len(receiver.calls) == 1
    finally:
        receiver.close()


def test_a_host_at_its_cap_is_not_called_and_its_slots_come_back():
    receiver, slots = Receiver(), HostSlots(1)
    try:
        assert slots.take("127.0.0.1")  # one delivery in flight to the host
        busy = attempt(to(receiver.url), SETTINGS, slots)
        assert busy.outcome is Outcome.BUSY and receiver.calls == []
        slots.give_back("127.0.0.1")
        done = attempt(to(receiver.url), SETTINGS, slots)
        assert done.outcome is Outcome.DELIVERED and len(receiver.calls) == 1
        assert slots.take("127.0.0.1")  # the attempt gave its slot back
    finally:
        receiver.close()


def test_an_unreachable_receiver_is_retried_and_a_refused_url_is_not():
    unreachable = attempt(to("http://127.0.0.1:1/hook"), SETTINGS, HostSlots(2))
    assert unreachable.outcome is Outcome.RETRY and "connect" in unreachable.detail
    refused = attempt(to("http://10.0.0.1/hook"), SETTINGS, HostSlots(2))
    assert refused.outcome is Outcome.REFUSED


def signature(secret: str, headers: dict, body: bytes) -> str:
    """Standard Webhooks' check, written out: HMAC-SHA256 with the base64 key after whsec_."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    content = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, content, hashlib.sha256).digest()).decode()


def test_a_delivery_is_signed_over_its_id_timestamp_and_body_with_its_tenants_key():
    receiver = Receiver()
    try:
        for owner in ("", "search-team", "batch-jobs"):
            assert attempt(to(receiver.url, owner), SETTINGS, HostSlots(2)).outcome \
                is Outcome.DELIVERED
        calls = receiver.calls
        for call, owner in zip(calls, ("", "search-team", "batch-jobs")):
            headers, body = call["headers"], call["body"]
            assert headers["webhook-id"] == "msg_1" and json.loads(body)["status"] == "succeeded"
            assert headers["webhook-signature"] == signature(
                receiver_secret("s3cret", owner), headers, body)
        # Each API key gets its own key, and so does a service without keys: never
        # IQ_WEBHOOK_SECRET itself, from which every tenant's key would follow.
        keys = {signing_key("s3cret", o) for o in ("", "search-team", "batch-jobs")}
        assert len(keys) == 3 and b"s3cret" not in keys
        assert receiver_secret("s3cret", "") != "whsec_" + base64.b64encode(b"s3cret").decode()
        assert calls[1]["headers"]["webhook-signature"] != signature(
            receiver_secret("s3cret", "batch-jobs"), calls[1]["headers"], calls[1]["body"])
    finally:
        receiver.close()


def test_the_secret_command_prints_each_receivers_secret(monkeypatch, capsys):
    from tasks.webhooks import main

    monkeypatch.setenv("IQ_WEBHOOK_SECRET", "s3cret")
    assert main(["tasks.webhooks", "secret", "search-team"]) == 0
    assert capsys.readouterr().out.strip() == receiver_secret("s3cret", "search-team")
    assert main(["tasks.webhooks", "secret"]) == 0
    assert capsys.readouterr().out.strip() == receiver_secret("s3cret", "")
    monkeypatch.setenv("IQ_WEBHOOK_SECRET", "change-me")
    assert main(["tasks.webhooks", "secret"]) == 1
    assert "IQ_WEBHOOK_SECRET" in capsys.readouterr().err


def signed(owner: str, delivery_id: str = "msg_1") -> tuple[dict, bytes]:
    """A delivery's headers and body, signed as the deliverer signs them."""
    body = json.dumps({"id": "job-1", "status": "succeeded"}).encode()
    return signed_headers(signing_key("s3cret", owner), delivery_id, body), body


def test_the_readme_receiver_says_value_error_for_a_missing_header():
    check = readme_receiver()
    secret = receiver_secret("s3cret", "")
    good, body = signed("")
    for name in ("webhook-id", "webhook-timestamp", "webhook-signature"):
        without = {k: v for k, v in good.items() if k != name}
        with pytest.raises(ValueError, match="missing or malformed"):
            check["verify"](secret, without, body)
    with pytest.raises(ValueError, match="missing or malformed"):
        check["verify"](secret, dict(good, **{"webhook-timestamp": "soon"}), body)
    assert check["verify"](secret, good, body)["id"] == "job-1"


class SlowSet(set):
    """A set whose membership test lets other threads run before it answers: the window
    between a receiver's check and its add, made wide enough to see."""

    def __contains__(self, item: object) -> bool:
        found = super().__contains__(item)
        time.sleep(0.001)
        return found


def test_the_readme_receiver_takes_one_delivery_once_however_many_threads_race():
    check = readme_receiver()
    check["seen_ids"] = SlowSet()
    secret = receiver_secret("s3cret", "tenant")
    deliveries = [signed("tenant", f"msg_{n}") for n in range(50)]
    taken: list[str] = []
    duplicates: list[str] = []
    start = threading.Barrier(8)

    def receive() -> None:
        start.wait()
        for delivery_headers, body in deliveries:
            try:
                check["verify"](secret, delivery_headers, body)
                taken.append(delivery_headers["webhook-id"])
            except check["Duplicate"]:
                duplicates.append(delivery_headers["webhook-id"])

    threads = [threading.Thread(target=receive) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(taken) == sorted(f"msg_{n}" for n in range(50))  # each exactly once
    assert len(duplicates) == 7 * 50
    assert issubclass(check["Duplicate"], ValueError)
