"""One delivery attempt (workers.webhooks.attempt) against real local receivers, without a
broker: what each answer means, and the per-host cap."""
from __future__ import annotations

import pytest

from config import load_settings
from tests.support.receivers import Receiver
from workers.webhooks import HostSlots, Outcome, attempt

SETTINGS = load_settings({"webhook_secret": "s3cret", "webhook_allow": "127.0.0.1",
                          "webhook_timeout_s": 10}, environ={})


@pytest.mark.parametrize("status, outcome", [
    (200, Outcome.DELIVERED), (204, Outcome.DELIVERED), (301, Outcome.FINAL),
    (302, Outcome.FINAL), (404, Outcome.FINAL), (408, Outcome.RETRY), (429, Outcome.RETRY),
    (500, Outcome.RETRY), (503, Outcome.RETRY),
])
def test_each_answer_is_delivered_final_or_retried(status, outcome):
    receiver = Receiver(status=status)
    try:
        result = attempt(receiver.url, "succeeded", "job-1", {"id": "job-1"}, SETTINGS,
                         HostSlots(2))
        assert (result.outcome, result.status) == (outcome, status)
        assert len(receiver.calls) == 1
    finally:
        receiver.close()


def test_a_host_at_its_cap_is_not_called_and_its_slots_come_back():
    receiver, slots = Receiver(), HostSlots(1)
    try:
        assert slots.take("127.0.0.1")  # one delivery in flight to the host
        busy = attempt(receiver.url, "succeeded", "job-2", {}, SETTINGS, slots)
        assert busy.outcome is Outcome.BUSY and receiver.calls == []
        slots.give_back("127.0.0.1")
        done = attempt(receiver.url, "succeeded", "job-2", {}, SETTINGS, slots)
        assert done.outcome is Outcome.DELIVERED and len(receiver.calls) == 1
        assert slots.take("127.0.0.1")  # the attempt gave its slot back
    finally:
        receiver.close()


def test_an_unreachable_receiver_is_retried_and_a_refused_url_is_not():
    unreachable = attempt("http://127.0.0.1:1/hook", "failed", "job-3", {}, SETTINGS,
                          HostSlots(2))
    assert unreachable.outcome is Outcome.RETRY and "connect" in unreachable.detail
    refused = attempt("http://10.0.0.1/hook", "failed", "job-3", {}, SETTINGS, HostSlots(2))
    assert refused.outcome is Outcome.REFUSED
