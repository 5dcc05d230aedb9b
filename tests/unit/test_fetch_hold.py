"""The fetch after a wake-up waits a few milliseconds while every pool child is busy, so that it
takes what arrives meanwhile in one round trip (workers/broker/fetch.py `FETCH_HOLD_S`); with a
child free it goes at once, and the event loop is woken when the wait ends."""
from __future__ import annotations

from time import monotonic
from types import SimpleNamespace

import pytest

from workers.broker import Broker
from workers.broker import fetch


class Loop:
    def __init__(self) -> None:
        self.later: list[float] = []

    def call_later(self, delay, callback, *args):
        self.later.append(delay)


class Channel:
    """What the fetch's QoS and its wake-up read of a channel."""
    _iq_consuming = True
    _in_poll = None
    _iq_reply = None
    _iq_hold_until = 0.0
    _hold_fetch = fetch.ReliableFetch._hold_fetch
    do_restore = False  # nothing to put back when the QoS is collected

    def __init__(self) -> None:
        self.connection = SimpleNamespace(_iq_loop=Loop())


@pytest.fixture
def state(monkeypatch):
    """The broker's state, on a clock that stands still: the wait is 5 ms, which a loaded
    machine's scheduler may take between two lines of a test (a CI failure, once)."""
    now = monotonic()
    monkeypatch.setattr(fetch, "monotonic", lambda: now)
    broker = Broker().install()
    yield broker
    broker.uninstall()


def qos(channel):
    return fetch.ReliableQoS(channel, prefetch_count=0)


def test_with_every_child_busy_the_fetch_after_a_wake_up_waits_then_goes(state):
    channel = Channel()
    state.children_busy = True
    channel._hold_fetch()
    assert not qos(channel).can_consume()
    assert channel.connection._iq_loop.later == [fetch.FETCH_HOLD_S]  # woken at its end
    channel._iq_hold_until = fetch.monotonic() - 0.001  # the wait is over
    assert qos(channel).can_consume() and channel._iq_hold_until == 0.0


def test_a_child_that_frees_ends_the_wait_and_with_one_free_nothing_waits(state):
    channel = Channel()
    state.children_busy = True
    channel._hold_fetch()
    state.children_busy = False  # a child returned its batch and found the buffer empty
    assert qos(channel).can_consume()
    channel._hold_fetch()
    assert channel._iq_hold_until == 0.0 and qos(channel).can_consume()
    assert channel.connection._iq_loop.later == [fetch.FETCH_HOLD_S]


def test_a_fetch_in_flight_is_read_whatever_the_wait(state):
    channel = Channel()
    state.children_busy = True
    channel._hold_fetch()
    channel._in_poll, channel._iq_reply = object(), "fetch"
    assert qos(channel).can_consume()
