"""A graceful reload of the API's gunicorn (SIGHUP: what a models reload sends, app/reloading.py,
or an operator), two API processes, default settings, under a steady stream of submits on
connections of their own: every submit is answered 202 within the request deadline, none
refused, while the processes are replaced. (Before, gunicorn's master told the old processes
to stop as soon as it forked the new ones, which then took seconds to import and build the
app: nothing accepted meanwhile, and every submit sent then waited in the listen queue, 3.3 s
on a loaded two-core machine, 5.9 s once; web/handover.py's hand-over.) The new processes are
held before they are up, as a loaded host holds them, so that the test does not depend on how
long they take."""
from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import psutil
import redis
import requests
import yaml

from config import Settings
from scripts.processes import resume
from scripts.stack import start_redis, start_web, wait_until
from tasks.keys import JOB_PREFIX

CLIENTS = 4


class Submits:
    """`CLIENTS` threads submitting one job at a time, each on a new connection: when each
    was sent, how long its answer took, and its status (or the error)."""

    def __init__(self, api: str) -> None:
        self.api, self.sent = api, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True)
                         for _ in range(CLIENTS)]

    def start(self) -> Submits:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                status: int | str = requests.post(
                    f"{self.api}/v1/jobs", json={"model": "quick", "inputs": ["x"]},
                    timeout=30).status_code
            except requests.RequestException as exc:
                status = repr(exc)
            self.sent.append((began, time.monotonic() - began, status))
            self._stop.wait(0.02)


def start_api(tmp_path, processes: int, **extra: str):
    """A Redis and gunicorn with `processes` API processes on the default settings, serving a
    synthetic model `quick` whose queue never fills: (redis, web)."""
    server = start_redis(tmp_path)
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": {"quick": {
        "kind": "synthetic", "max_queue_depth": 1_000_000}}}))
    base = {k: v for k, v in os.environ.items() if not k.startswith("IQ_")}
    env = dict(base, REDIS_URL=server.extra["url"], IQ_MODELS_FILE=str(models),
               IQ_WEB_WORKERS=str(processes), PYTHONUNBUFFERED="1", **extra)
    return server, start_web(env, tmp_path)


def processes(master: int) -> set[int]:
    return {child.pid for child in psutil.Process(master).children()}


@contextmanager
def hung_up_under_submits(tmp_path, count: int) -> Iterator[tuple[int, set[int], Submits, float]]:
    """gunicorn with `count` API processes under a steady stream of submits, then told to
    reload (SIGHUP): (its master, the old processes, the submits, when it was told). The
    submits, gunicorn and Redis stopped as the block ends."""
    server, web = start_api(tmp_path, count)
    submits = None
    try:
        master = web.proc.pid
        wait_until(lambda: len(processes(master)) == count, 60, f"{count} API processes")
        old = processes(master)
        submits = Submits(web.extra["url"]).start()
        wait_until(lambda: len(submits.sent) >= 20, 60, "submits answered before the reload")
        hup = time.monotonic()
        os.kill(master, signal.SIGHUP)
        yield master, old, submits, hup
    finally:
        if submits is not None:
            submits.stop()
        web.stop()
        server.stop()


def await_replaced(master: int, old: set[int], count: int, submits: Submits) -> float:
    """When the old API processes were gone and `count` new ones left, once 20 submits sent
    after it were answered."""
    wait_until(lambda: not processes(master) & old and len(processes(master)) == count, 120,
               f"the old API processes replaced by {count} new")
    replaced = time.monotonic()
    wait_until(lambda: sum(1 for t, _, _ in submits.sent if t > replaced) >= 20, 60,
               "submits answered by the new processes")
    return replaced


def sent_across(submits: Submits, hup: float, replaced: float) -> list[tuple]:
    """The submits sent from the SIGHUP until the processes were replaced, (sent s after the
    SIGHUP, waited s, status); every submit of the run answered 202."""
    across = [(round(t - hup, 2), round(took, 3), status) for t, took, status in submits.sent
              if hup <= t <= replaced]
    assert {status for _, _, status in submits.sent} == {202}, \
        [s for s in across if s[2] != 202]
    return across


def test_submits_wait_no_longer_than_their_deadline_while_gunicorn_reloads(tmp_path):
    with hung_up_under_submits(tmp_path, 2) as (master, old, submits, hup):
        # The new processes held (SIGSTOP) before they are up, as a loaded host holds them
        # importing the app, until a submit sent more than a deadline after was answered
        # (the old processes serve meanwhile), or three deadlines passed (none was).
        wait_until(lambda: len(processes(master) - old) == 2, 30, "the new processes forked")
        new = processes(master) - old
        for pid in new:
            os.kill(pid, signal.SIGSTOP)
        held, span = time.monotonic(), Settings.redis_deadline_s
        try:
            wait_until(lambda: any(t > held + span for t, _, _ in submits.sent), 3 * span,
                       "a submit answered a deadline after the new processes were held")
        except TimeoutError:
            pass  # said below: how long they waited
        finally:
            for pid in new:
                os.kill(pid, signal.SIGCONT)
        replaced = await_replaced(master, old, 2, submits)
    across = sent_across(submits, hup, replaced)
    assert len(across) >= CLIENTS, "submits were sent while the processes were replaced"
    deadline_s = Settings.redis_deadline_s
    late = [s for s in across if s[1] >= deadline_s]
    assert not late, f"submits (sent s after the SIGHUP, waited s) past the {deadline_s:g}s " \
                     f"deadline: {late}"


def test_a_stop_during_the_hand_over_ends_within_the_stop_timeout_nothing_killed(tmp_path):
    """gunicorn's master told to stop (SIGTERM) while a reload's hand-over waits for new
    processes that are not up (held, as a loaded host holds them importing the app): the old
    processes stop waiting, finish what they hold (a `Prefer: wait` submit is answered), and the
    master exits within IQ_STOP_TIMEOUT_S, no process SIGKILLed. (Before, the old processes
    waited for their replacements up to gunicorn's `timeout`, 60 s, while the master waited for
    them in its reload; a new process that got the master's SIGTERM before it set its handlers
    lost it and was SIGKILLed at graceful_timeout: 70 s in all on a loaded two-core machine.)"""
    server, web = start_api(tmp_path, 2)
    store = redis.Redis.from_url(server.extra["url"])
    old: set[int] = set()
    new: set[int] = set()
    answer: dict[str, object] = {}

    def held_submit() -> None:  # no Celery worker: answered 202 once its wait is over
        try:
            answer["status"] = requests.post(
                f"{web.extra['url']}/v1/jobs", json={"model": "quick", "inputs": ["x"]},
                headers={"Prefer": "wait=4"}, timeout=60).status_code
        except requests.RequestException as exc:
            answer["status"] = repr(exc)

    try:
        master = web.proc.pid
        wait_until(lambda: len(processes(master)) == 2, 60, "two API processes")
        old = processes(master)
        os.kill(master, signal.SIGHUP)
        wait_until(lambda: len(processes(master) - old) == 2, 30, "the new processes forked")
        new = processes(master) - old
        for pid in new:
            os.kill(pid, signal.SIGSTOP)
        submit = threading.Thread(target=held_submit, daemon=True)
        submit.start()
        wait_until(lambda: next(store.scan_iter(match=f"{JOB_PREFIX}*"), None), 30,
                   "the held submit taken by an old process")
        stop = time.monotonic()
        os.kill(master, signal.SIGTERM)
        wait_until(lambda: not processes(master) & old, 90, "the old processes gone")
        old_gone = time.monotonic() - stop
        for pid in new:  # now they may come up (or stop: the master told them to)
            os.kill(pid, signal.SIGCONT)
        web.proc.wait(90)
        exited = time.monotonic() - stop
        submit.join(30)
    finally:
        resume(new)
        web.stop()
        server.stop()
    log = web.log.read_text(errors="replace")
    bound = Settings.stop_timeout_s
    print(f"stop: old processes gone {old_gone:.1f}s, master exited {exited:.1f}s in")
    assert answer.get("status") == 202, answer
    assert old_gone < bound and exited < bound, \
        f"stop took {exited:.1f}s (old processes gone {old_gone:.1f}s in), past {bound:g}s"
    # A process SIGKILLed (gunicorn's master does at graceful_timeout) says nothing at its end.
    ended = {pid for pid in old | new if f"Worker exiting (pid: {pid})" in log}
    assert ended == old | new and "SIGKILL" not in log, web.tail()
    assert web.proc.returncode == 0, web.tail()
