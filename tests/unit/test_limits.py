"""A key's share of an API process (app/limits.py), on a fake clock: its read budget charges
what a read costs and refills at its rate; its upload slots are its own."""
from __future__ import annotations

import pytest

from app.limits import NoUpload, OverBudget, ReadBudget, Uploads


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_read_costs_what_it_scans_and_the_budget_refills_at_its_rate():
    clock = Clock()
    reads = ReadBudget(rate=20, burst=600, clock=clock)
    reads.charge("lister", 500)  # a filtered page
    with pytest.raises(OverBudget) as refused:
        reads.charge("lister", 500)
    assert refused.value.wait_s == pytest.approx(20) and refused.value.retry_after == 20
    reads.charge("lister", 100)  # a refusal takes nothing: the 100 left still pay
    with pytest.raises(OverBudget):
        reads.charge("lister", 1)
    reads.charge("alice", 600)  # another key's budget is its own
    clock.now += 25
    reads.charge("lister", 500)
    clock.now += 1000
    reads.charge("lister", 600)  # refilled to its burst, no further


def test_a_cost_over_the_burst_is_charged_as_the_burst_and_no_rate_is_no_limit():
    clock = Clock()
    reads = ReadBudget(rate=1, burst=10, clock=clock)
    reads.charge("k", 1000)  # a full bucket pays any read
    with pytest.raises(OverBudget):
        reads.charge("k", 1000)
    open_ = ReadBudget(rate=0, burst=0, clock=clock)
    for _ in range(10_000):
        open_.charge("k", 500)


def test_a_key_holds_at_most_its_upload_slots_and_gets_them_back():
    uploads = Uploads(per_key=2)
    with uploads.hold("t"), uploads.hold("t"):
        with pytest.raises(NoUpload, match="2 request bodies"):
            with uploads.hold("t"):
                pass
        with uploads.hold("alice"), uploads.hold(None), uploads.hold(None), uploads.hold(None):
            assert uploads.held("alice") == 1  # no key: no cap
        assert uploads.held("t") == 2
    assert uploads.held("t") == 0
    with pytest.raises(RuntimeError):
        with uploads.hold("t"):
            raise RuntimeError("a body that failed to arrive")
    assert uploads.held("t") == 0
