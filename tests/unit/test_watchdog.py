"""The worker watchdog's decisions, on a fake clock (workers/batching/watchdog.py)."""
from __future__ import annotations

from workers.batching.watchdog import Watchdog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watchdog(limit: float = 60.0) -> tuple[Watchdog, Clock, list[str]]:
    clock = Clock()
    dog = Watchdog(limit, liveness=None, clock=clock)
    restarts: list[str] = []
    dog.restart = restarts.append  # type: ignore[method-assign]
    dog.active = True
    return dog, clock, restarts


def test_a_loop_that_keeps_ticking_is_never_stalled():
    dog, clock, _ = watchdog()
    for _ in range(100):
        clock.now += 5
        dog.beat()
        assert not dog.loop_stalled()


def test_a_loop_silent_past_the_limit_is_stalled_unless_paused():
    dog, clock, _ = watchdog()
    dog.beat()
    clock.now += 59
    assert not dog.loop_stalled()
    clock.now += 2
    assert dog.loop_stalled()
    dog.pause()  # reconnecting or shutting down: the loop is busy with that
    assert not dog.loop_stalled()


def test_idle_with_jobs_waiting_restarts_only_after_the_limit_without_a_break():
    dog, clock, restarts = watchdog()
    for _ in range(11):
        dog.observe_idle_with_work(True)
        clock.now += 5
    assert restarts == []  # 50 s so far
    dog.observe_idle_with_work(False)  # it fetched something: the clock starts again
    for _ in range(12):
        dog.observe_idle_with_work(True)
        clock.now += 5
    assert restarts == []
    clock.now += 5
    dog.observe_idle_with_work(True)
    assert len(restarts) == 1 and "jobs waiting" in restarts[0]


def test_a_limit_of_zero_turns_it_off():
    dog, clock, restarts = watchdog(limit=0)
    dog.observe_idle_with_work(True)
    clock.now += 10_000
    dog.observe_idle_with_work(True)
    assert not dog.loop_stalled() and restarts == []
