"""Group commit (tasks/group_commit.py) with a send that the test holds: a lone call goes at
once and alone; calls that arrive while one is on its way go together in the next; a group's
error is each member's; a call whose deadline passes while it queues is never sent."""
from __future__ import annotations

import threading

import pytest
import redis

from scripts.processes import wait_until
from tasks import redis_deadline
from tasks.group_commit import GroupCommit


class HeldSend:
    """A send whose calls block until `release()`; records each group it was given."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.groups: list[list[int]] = []
        self.gate = threading.Event()
        self.fail = fail
        self.entered = threading.Event()

    def __call__(self, items):
        self.groups.append(list(items))
        self.entered.set()
        assert self.gate.wait(10)
        if self.fail is not None:
            raise self.fail
        return [item * 10 for item in items]


def _in_request(group: GroupCommit, item: int, out: dict, seconds: float = 10) -> None:
    with redis_deadline.deadline(seconds):
        try:
            out[item] = group.submit(item)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out[item] = exc


def _start(group, items, out, seconds=10) -> list[threading.Thread]:
    threads = [threading.Thread(target=_in_request, args=(group, i, out, seconds))
               for i in items]
    for thread in threads:
        thread.start()
    return threads


def _behind_one_on_its_way(group, send, items, out, seconds=10):
    """A call on its way (held in `send`), then `items` started behind it: both threads."""
    first = _start(group, [0], out)
    assert send.entered.wait(5)
    return first, _start(group, items, out, seconds)


def test_a_lone_call_is_sent_at_once_and_alone():
    send = HeldSend()
    send.gate.set()
    group, out = GroupCommit(send), {}
    _in_request(group, 1, out)
    assert out == {1: 10} and send.groups == [[1]]


def test_calls_arriving_while_one_is_on_its_way_go_together_in_the_next():
    send = HeldSend()
    group, out = GroupCommit(send, most=4), {}
    first, others = _behind_one_on_its_way(group, send, range(1, 7), out)
    wait_until(lambda: len(group._queued) == 6, 10, "six calls queued behind the first")
    send.gate.set()
    for thread in first + others:
        thread.join(10)
    assert out == {i: i * 10 for i in range(7)}
    assert send.groups[0] == [0]
    assert sorted(send.groups[1] + send.groups[2]) == list(range(1, 7))
    assert [len(g) for g in send.groups] == [1, 4, 2]  # at most `most` a call
    assert group.calls == 3 and group.items == 7 and not group._busy


def test_a_groups_error_is_each_members_own():
    send = HeldSend(fail=redis.ConnectionError("gone"))
    group, out = GroupCommit(send), {}
    first, others = _behind_one_on_its_way(group, send, [1, 2], out)
    wait_until(lambda: len(group._queued) == 2, 10, "two calls queued")
    send.gate.set()
    for thread in first + others:
        thread.join(10)
    assert all(isinstance(out[i], redis.ConnectionError) for i in range(3))
    assert not group._busy  # the next call goes at once
    send.fail = None
    _in_request(group, 9, out)
    assert out[9] == 90


def test_a_call_whose_deadline_passes_while_it_queues_is_never_sent():
    send = HeldSend()
    group, out = GroupCommit(send), {}
    first, late = _behind_one_on_its_way(group, send, [1], out, seconds=0.2)
    for thread in late:
        thread.join(10)
    assert isinstance(out[1], redis_deadline.DeadlinePassed)
    send.gate.set()
    for thread in first:
        thread.join(10)
    assert send.groups == [[0]] and out[0] == 0 and not group._queued


def test_outside_a_request_a_call_goes_alone():
    send = HeldSend()
    send.gate.set()
    group = GroupCommit(send)
    group._busy = True  # as if another call were on its way
    assert group.submit(3) == 30 and send.groups == [[3]]


@pytest.mark.parametrize("most", [1, 2])
def test_the_queue_is_handed_on_until_it_is_empty(most):
    send = HeldSend()
    group, out = GroupCommit(send, most=most), {}
    first, others = _behind_one_on_its_way(group, send, range(1, 4), out)
    wait_until(lambda: len(group._queued) == 3, 10, "three calls queued")
    send.gate.set()
    for thread in first + others:
        thread.join(10)
    assert out == {i: i * 10 for i in range(4)} and not group._busy
    assert sum(len(g) for g in send.groups) == 4 and max(len(g) for g in send.groups) <= most


def test_calls_made_runnable_while_the_first_gathers_go_with_it():
    """`gather` runs before a group goes (the API's: the greenlets already runnable run): the
    calls it lets reach their submit join the first one's call instead of queueing for the
    next, up to `most`; the first does not go alone while they wait behind it."""
    send, out, threads, gathered = HeldSend(), {}, [], []
    send.gate.set()

    def gather():
        gathered.append(1)
        if len(gathered) == 1:
            threads.extend(_start(group, [1, 2, 3], out))
            wait_until(lambda: len(group._queued) == 3, 10, "three calls queued behind it")

    group = GroupCommit(send, most=3, gather=gather)
    _in_request(group, 0, out)
    for thread in threads:
        thread.join(10)
    assert out == {i: i * 10 for i in range(4)}
    assert send.groups == [[0, 1, 2], [3]] and group.calls == 2
    assert len(gathered) == 2 and not group._busy


def test_a_lone_call_that_gathers_nothing_goes_at_once_and_alone():
    send, out, gathered = HeldSend(), {}, []
    send.gate.set()
    group = GroupCommit(send, gather=lambda: gathered.append(1))
    _in_request(group, 1, out)
    assert out == {1: 10} and send.groups == [[1]] and gathered == [1]


def test_under_gevent_the_greenlets_already_runnable_join_the_first_call():
    """The API's gather (app/store.py `ready_first`, gunicorn's gevent worker): requests that
    are runnable when the first of them reaches its submit (their bytes read in the same turn
    of the event loop) go in its call, not one alone and the rest in the next; with threading
    unpatched (a script, a test) there is none."""
    import subprocess
    import sys

    code = """
import gevent.monkey; gevent.monkey.patch_all()
import gevent
from app.store import ready_first
from tasks import redis_deadline
from tasks.group_commit import GroupCommit
groups = []
def send(items):
    groups.append(list(items))
    gevent.sleep(0.01)  # the round trip: the hub runs others meanwhile
    return [i * 10 for i in items]
group = GroupCommit(send, gather=ready_first())
def request(i):
    with redis_deadline.deadline(10):
        return group.submit(i)
jobs = [gevent.spawn(request, i) for i in range(5)]
gevent.joinall(jobs, timeout=10)
assert [j.value for j in jobs] == [0, 10, 20, 30, 40], [j.value for j in jobs]
print(groups)
"""
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "[[0, 1, 2, 3, 4]]"
    from app.store import ready_first

    assert ready_first() is None
