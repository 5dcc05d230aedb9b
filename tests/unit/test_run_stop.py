"""make run's stop in order (scripts/run_stop.py), on stand-in processes with make run's names:
each step is signalled once the one before has gone (Redis last; the deliverer and Flower with
the API and the worker), a frozen Redis is woken before its SIGTERM, a hang-up stops it as
Ctrl-C does, and what outlives the stop's bound is killed, saying so."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from scripts.processes import ROOT, wait_until

# A stand-in: it says when it gets its SIGTERM and exits `linger` seconds later (a worker
# finishing its batch), or never (`ignore`).
PART = "trap 'echo {name} got TERM; sleep {linger}; echo {name} leaves; exit 0' TERM; " \
       "echo {name} running; while :; do sleep 0.05; done"
STUCK = "trap '' TERM; echo {name} running; while :; do sleep 0.05; done"

DRIVER = textwrap.dedent("""
    import sys
    from honcho.printer import Printer
    from scripts.run_stop import OrderedManager
    manager = OrderedManager(Printer(sys.stdout), float(sys.argv[1]))
    for name, command in zip(sys.argv[2::2], sys.argv[3::2]):
        manager.add_process(name, command)
    manager.loop()
    sys.exit(manager.returncode or 0)
""")


def start(tmp_path: Path, timeout_s: float, parts: dict[str, str]) -> tuple[subprocess.Popen,
                                                                             Path]:
    log = tmp_path / "run.log"
    args = [a for name, command in parts.items() for a in (name, command)]
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(timeout_s), *args],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                start_new_session=True)
    wait_until(lambda: all(f"{name} running" in log.read_text() for name in parts), 30,
               "every part running")
    return proc, log


def line_of(lines: list[str], text: str) -> int:
    return next(i for i, line in enumerate(lines) if text in line)


def test_each_step_waits_for_the_one_before_and_redis_goes_last(tmp_path):
    parts = {"redis": PART.format(name="redis", linger=0),
             "webhooks": PART.format(name="webhooks", linger=0.5),
             "flower": PART.format(name="flower", linger=0),
             "worker": PART.format(name="worker", linger=1.0),
             "web": PART.format(name="web", linger=0)}
    proc, log = start(tmp_path, 20, parts)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole group
    assert proc.wait(30) == 130
    lines = log.read_text().splitlines()
    # The deliverer and Flower depend on no worker: they are told with the API and the
    # worker, and have the whole stop's time (a deliverer told after the worker was killed).
    first_step = [line_of(lines, f"{name} got TERM") for name in ("web", "worker", "webhooks",
                                                                  "flower")]
    assert max(first_step) < line_of(lines, "worker leaves") < line_of(lines, "redis got TERM")
    assert line_of(lines, "webhooks leaves") < line_of(lines, "redis got TERM")
    assert "SIGKILL" not in log.read_text()
    assert "nothing killed" in lines[-1]


def test_a_frozen_redis_is_woken_first_and_stops_on_its_sigterm_last(tmp_path):
    # A Redis frozen by SIGSTOP acts on no SIGTERM: it was killed at the stop's bound.
    redis = "trap 'echo redis got TERM; exit 0' TERM; echo redis running as $$; " \
            "while :; do sleep 0.05; done"
    parts = {"redis": redis, "worker": PART.format(name="worker", linger=0)}
    proc, log = start(tmp_path, 2, parts)
    pid = int(re.search(r"redis running as (\d+)", log.read_text()).group(1))
    os.kill(pid, signal.SIGSTOP)
    began = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(30) == 130
    assert time.monotonic() - began < 2 + 2, log.read_text()  # not held to the bound
    lines = log.read_text().splitlines()
    # Woken before the first step (the worker's), so that the stop drains as with a Redis
    # that runs; then told last.
    assert line_of(lines, "sending SIGCONT to redis") < line_of(lines, "sending SIGTERM to worker") \
        < line_of(lines, "sending SIGTERM to redis")
    # It acted on that SIGTERM (its own line may come before make run's: two processes).
    assert line_of(lines, "redis got TERM") > line_of(lines, "sending SIGTERM to worker")
    assert "SIGKILL" not in log.read_text()
    assert "nothing killed" in lines[-1]


def test_a_hang_up_stops_every_part(tmp_path):
    parts = {"redis": PART.format(name="redis", linger=0),
             "worker": PART.format(name="worker", linger=0)}
    proc, log = start(tmp_path, 20, parts)
    os.killpg(proc.pid, signal.SIGHUP)  # the terminal closed: its readers get it too
    assert proc.wait(30) == 129
    text = log.read_text()
    assert "SIGHUP received" in text and "redis leaves" in text and "worker leaves" in text


def test_what_outlives_the_bound_is_killed_and_said(tmp_path):
    marks = tmp_path / "marks"
    redis = f"trap 'date +%s.%N >> {marks}; exit 0' TERM; echo redis running; " \
            "while :; do sleep 0.05; done"
    parts = {"worker": STUCK.format(name="worker"), "redis": redis}
    proc, log = start(tmp_path, 1, parts)
    began = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(30) == 143
    took = time.time() - began
    text = log.read_text()
    assert "worker still running" in text and "SIGKILL to worker" in text
    assert "SIGKILL to redis" not in text
    # Redis waited for the stuck worker until its step's bound (1 + 2 s), not until the kill.
    redis_term = float(marks.read_text()) - began
    assert 1 + 2 <= redis_term < 1 + 5, redis_term
    assert 1 + 5 <= took < 1 + 5 + 5, took


def test_an_api_left_holding_waits_gets_its_quick_stop_once_the_worker_is_gone(tmp_path):
    # gunicorn lets a client's `?wait` run out on SIGTERM (up to 35 s): its quick stop
    # (SIGQUIT) ends it once nothing would change a job any more.
    # gunicorn's master, in Python as it is (a shell's trap missed the SIGQUIT twice in full
    # runs here, never alone); it says what it blocks and ignores, should it miss it again.
    web = (f"{sys.executable} -c \"import signal, sys, time; "
           "signal.signal(signal.SIGTERM, lambda *a: print('web got TERM', flush=True)); "
           "signal.signal(signal.SIGQUIT, lambda *a: (print('web got QUIT', flush=True), "
           "sys.exit(0))); "
           "print('web running', *[line.strip() for line in open('/proc/self/status') "
           "if line.startswith(('SigBlk', 'SigIgn'))], flush=True); "
           "[time.sleep(0.05) for _ in iter(int, 1)]\"")
    parts = {"web": web, "worker": PART.format(name="worker", linger=0.5),
             "redis": PART.format(name="redis", linger=0)}
    proc, log = start(tmp_path, 20, parts)
    began = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(30) == 130
    assert time.monotonic() - began < 10, log.read_text()
    lines = log.read_text().splitlines()
    assert line_of(lines, "web got TERM") < line_of(lines, "worker leaves") \
        < line_of(lines, "web got QUIT") < line_of(lines, "redis got TERM")
    assert "SIGKILL" not in log.read_text()
