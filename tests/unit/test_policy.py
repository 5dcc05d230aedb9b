"""The batching policy on its own: no broker, no worker, a fake clock."""
from __future__ import annotations

import pytest

from workers.batching.policy import BatchScheduler, ModelBuffer


def make(max_batch=4, max_wait_s=0.010, models=("m",)):
    s = BatchScheduler()
    for m in models:
        s.add_model(m, max_batch, max_wait_s)
    return s


def ids(batches):
    return [[p.job for p in b.jobs] for b in batches]


def test_lone_job_on_idle_worker_dispatches_at_once():
    s = make(max_wait_s=60)
    s.add("m", "a", 1, now=0.0)
    assert ids(s.batches(now=0.0, idle=1, busy=0)) == [["a"]]


def test_idle_child_beside_a_busy_one_waits_for_the_deadline():
    s = make(max_wait_s=0.010)
    s.add("m", "a", 1, now=0.0)
    assert s.batches(now=0.005, idle=1, busy=1) == []
    assert s.next_deadline() == pytest.approx(0.010)
    assert ids(s.batches(now=0.010, idle=1, busy=1)) == [["a"]]


def test_full_buffer_dispatches_before_the_deadline():
    s = make(max_batch=3, max_wait_s=10)
    for j in "abc":
        s.add("m", j, 1, now=0.0)
    assert ids(s.batches(now=0.001, idle=1, busy=1)) == [["a", "b", "c"]]


def test_while_all_children_busy_jobs_only_accumulate():
    s = make(max_wait_s=0.0)
    for j in "abcdef":
        s.add("m", j, 1, now=0.0)
    assert s.batches(now=5.0, idle=0, busy=2) == []
    assert len(s) == 6


def test_a_freed_child_takes_everything_waiting_up_to_the_cap():
    s = make(max_batch=4, max_wait_s=10)
    for j in "abcdef":
        s.add("m", j, 1, now=0.0)
    assert ids(s.batches(now=0.001, idle=1, busy=1, freed=1)) == [["a", "b", "c", "d"]]
    # The rest waits: its deadline has not passed and no other child is free.
    assert s.batches(now=0.001, idle=0, busy=2) == []
    assert len(s) == 2


def test_size_cap_counts_items_not_jobs():
    s = make(max_batch=4)
    s.add("m", "three", 3, now=0.0)
    s.add("m", "two", 2, now=0.0)
    s.add("m", "one", 1, now=0.0)
    batches = s.batches(now=1.0, idle=3, busy=0)  # past the deadline: all may leave
    # FIFO: "two" would overflow the first batch, so it opens the next one.
    assert ids(batches) == [["three"], ["two", "one"]]
    assert [b.items for b in batches] == [3, 3]


def test_a_job_larger_than_the_cap_forms_its_own_batch():
    s = make(max_batch=4)
    s.add("m", "big", 10, now=0.0)
    s.add("m", "small", 1, now=0.0)
    batches = s.batches(now=1.0, idle=2, busy=0)
    assert ids(batches) == [["big"], ["small"]]
    assert batches[0].items == 10


def test_discarded_jobs_are_dropped_when_the_batch_forms():
    s = make(max_batch=4)
    for j in ["a", "revoked", "b"]:
        s.add("m", j, 1, now=0.0)
    dropped = []

    def discard(job):
        if job == "revoked":
            dropped.append(job)
            return True
        return False

    assert ids(s.batches(now=0.0, idle=1, busy=0, discard=discard)) == [["a", "b"]]
    assert dropped == ["revoked"] and len(s) == 0


def test_a_batch_of_only_discarded_jobs_is_never_sent():
    s = make()
    s.add("m", "gone", 1, now=0.0)
    assert s.batches(now=0.0, idle=1, busy=0, discard=lambda j: True) == []
    assert len(s) == 0


def test_longest_waiting_model_goes_first():
    s = make(models=("x", "y"))
    s.add("y", "y1", 1, now=0.0)
    s.add("x", "x1", 1, now=0.5)
    batches = s.batches(now=1.0, idle=1, busy=0)
    assert [b.model for b in batches] == ["y"]


def test_after_the_first_batch_the_rest_waits_for_size_or_deadline():
    s = make(max_batch=4, max_wait_s=0.010)
    for j in "abcde":
        s.add("m", j, 1, now=0.0)
    # Worker idle: the first batch leaves at once; the second child now sits beside a busy
    # one, so the lone leftover waits for its deadline.
    assert ids(s.batches(now=0.0, idle=2, busy=0)) == [["a", "b", "c", "d"]]
    assert ids(s.batches(now=0.010, idle=1, busy=1)) == [["e"]]


def test_one_idle_child_gets_one_batch():
    s = make(max_batch=2)
    for j in "abcd":
        s.add("m", j, 1, now=0.0)
    assert len(s.batches(now=0.0, idle=1, busy=0)) == 1
    assert len(s) == 2


def test_no_deadline_when_nothing_is_buffered():
    assert make().next_deadline() is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_max_batch_size_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1"):
        ModelBuffer("m", bad, 0.01)


def test_higher_priority_jobs_leave_first_even_when_buffered_later():
    s = make(max_batch=2)
    for j in ("low1", "low2", "low3"):
        s.add("m", j, 1, now=0.0, priority=9)
    s.add("m", "high", 1, now=0.5, priority=0)
    s.add("m", "normal", 1, now=0.6, priority=5)
    assert ids(s.batches(now=1.0, idle=1, busy=1, freed=1)) == [["high", "normal"]]
    assert ids(s.batches(now=1.0, idle=1, busy=1, freed=1)) == [["low1", "low2"]]


def test_a_job_removed_from_its_buffer_is_in_no_batch():
    s = make(max_batch=4, models=("m", "n"))
    first, second = object(), object()  # jobs are told apart by identity, not equality
    s.add("m", first, 1, now=0.0)
    s.add("m", second, 2, now=0.1)
    assert s.remove(first) and not s.remove(first)
    assert len(s) == 1 and s.buffers["m"].items == 2
    assert ids(s.batches(now=1.0, idle=1, busy=0)) == [[second]]
    assert not s.remove(second)  # handed out: in no buffer


def test_drain_keeps_the_jobs_marked_alone_when_asked():
    s = make(models=("m", "n"))
    s.add("m", "a", 1, now=0.0)
    s.add("m", "lost", 1, now=0.0, alone=True)
    s.add("n", "b", 2, now=0.0)
    assert sorted(p.job for p in s.drain(keep_alone=True)) == ["a", "b"]
    assert ids(s.batches(now=0.0, idle=2, busy=0)) == [["lost"]]
    s.add("m", "again", 1, now=1.0, alone=True)
    assert [p.job for p in s.drain()] == ["again"]
    assert len(s) == 0


def test_a_held_models_jobs_wait_past_their_deadline_and_leave_once_released():
    # A reload's new model while a child on the previous file (which lacks it) may take a
    # batch: its jobs wait, the other models' are served, and no timer is armed for them.
    s = make(max_wait_s=0.010, models=("m", "new"))
    s.held.add("new")
    s.add("new", "n1", 1, now=0.0)
    s.add("m", "a", 1, now=0.5)
    assert s.next_deadline() == pytest.approx(0.510)
    assert ids(s.batches(now=1.0, idle=2, busy=0)) == [["a"]]
    assert s.next_deadline() is None and len(s) == 1
    s.held.clear()
    assert ids(s.batches(now=1.0, idle=1, busy=0)) == [["n1"]]
