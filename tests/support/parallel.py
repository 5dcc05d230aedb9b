"""How the suite is spread over pytest-xdist's processes (pytest.ini: `-n 5 --dist loadgroup`).

The suite mostly waits: a fault test on the defaults waits out a visibility timeout or the
watchdog, on a private stack of its own, with the CPU idle. So it runs in five processes on
two cores, and xdist hands each process its next test, or group of tests, in the order `plan`
sets:

* Tests that share a stack run in one process, which starts it once: those of the session
  stack (`stack`, tests/conftest.py) and of the fault stack (`faults`), each a group, and
  those of a module-scoped fixture (a module's private stack), a group for each module.
* First the `slow` tests and the session stacks' groups (the longest units), so that the
  longest waits start at once instead of last; `serial` tests at the very end.
* A `serial` test runs with no other test running in any process: each test holds a lock
  shared, a serial one holds it alone (`turn`). For what a neighbour would distort (a
  benchmark's latency split, a timing of sleeps, a deadline on CPU work), not for what a
  loaded machine must survive.
"""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from typing import Iterator

import pytest

SHARED_STACKS = ("stack", "faults")  # session fixtures that start a stack


def group_of(item: pytest.Item) -> str | None:
    """The xdist group that keeps `item` beside the tests it shares a stack with."""
    fixtures = item._fixtureinfo.name2fixturedefs  # what pytest resolved for this test
    for name in SHARED_STACKS:
        if name in fixtures and fixtures[name][-1].scope == "session":
            return name
    if any(defs[-1].scope in ("module", "class") for defs in fixtures.values()):
        return item.nodeid.split("::", 1)[0]
    return None


def rank(item: pytest.Item) -> int:
    if item.get_closest_marker("serial"):
        return 2
    first = item.get_closest_marker("slow") or group_of(item) in SHARED_STACKS
    return 0 if first else 1


def plan(items: list[pytest.Item]) -> None:
    """Group the tests that share a stack, and order them: slow first, serial last, each
    group's tests together (where its earliest test goes) and in their own order."""
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        group = "serial" if item.get_closest_marker("serial") else group_of(item)
        if group and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
        marker = item.get_closest_marker("xdist_group")
        name = (marker.args or [marker.kwargs.get("name")])[0] if marker else item.nodeid
        units.setdefault(name, []).append(item)
    ordered = sorted(units.values(), key=lambda unit: min(rank(item) for item in unit))
    items[:] = [item for unit in ordered for item in unit]


@contextmanager
def turn(item: pytest.Item) -> Iterator[None]:
    """Hold the run's lock while `item` runs (its setup and teardown included): shared, or
    alone for a `serial` test. Outside xdist there is no one to wait for."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    # The directory every process's basetemp is in: one per run.
    path = item.config._tmp_path_factory.getbasetemp().parent / "serial.lock"
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if item.get_closest_marker("serial") else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    plan(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item):
    with turn(item):
        return (yield)
