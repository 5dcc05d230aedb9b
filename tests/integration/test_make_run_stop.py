"""`make run`'s stop under load, on the default settings: Ctrl-C (SIGINT to its process group,
as a terminal sends it), SIGTERM to make run alone (`kill`), and a hang-up (SIGHUP to its
group: the terminal closed) each stop the stack in order (scripts/run_stop.py): the API and
the worker first, the worker's running batch finishing and storing its results, Redis last.
The stop ends within IQ_STOP_TIMEOUT_S with nothing killed, no process left and every port
free; after a second `make run`, every job accepted before the stop ended has succeeded
exactly once, counted by its record's `runs` (one per start by a pool child, a batch killed
half-way included) and by the model's log of the inputs it returned.

And every process leaves on SIGTERM within the stop timeout with its Redis frozen (every call
waits out its socket timeout): the worker, the deliverer and Flower stayed for minutes. A
`make run` stopped under load with its Redis frozen (SIGSTOP) still stops in order and kills
nothing and runs no job twice: Redis is woken (SIGCONT) as the stop begins, so that the
running batch stores its results and Redis shuts down on its SIGTERM writing its file (it was
killed), and the deliverer and Flower are told with the API and the worker, not 27 s in (the
deliverer was killed at 30.5 s)."""
from __future__ import annotations

import os
import re
import secrets
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import redis
import requests
import yaml

from config import Settings
from workers.batching.stopping import LAST_RESORT_S
from scripts.processes import resume
from scripts.stack import ROOT, free_port, launch, spawn, start_webhooks, wait_until
from tests.integration.test_make_run import MakeRun, run_env, secret
from tests.support.load import Load, job_statuses, runs
from tests.support.records import fields_of

pytestmark = pytest.mark.slow

STOP_S = Settings.stop_timeout_s
HOW = {"ctrl-c": (signal.SIGINT, True), "sigterm": (signal.SIGTERM, False),
       "hang-up": (signal.SIGHUP, True)}


def slow_model(log) -> dict:
    # 1.5 s a batch: a stop sent while a batch is seen running lands in it. Up to 64 a batch:
    # the jobs the clients sent through the stop and the restart (~270) finish in a few
    # batches, not in 35 batches of 8 (~50 s of the test's time, checking nothing more).
    return {"models": {"slow": {"kind": "synthetic", "base_ms": 1500, "per_item_ms": 0,
                                "max_batch_size": 64, "max_inputs": 1, "runs_log": str(log)}}}


def stopped_lines(output: str) -> dict[str, int]:
    """Where in make run's output each process was seen stopped (honcho's `NAME stopped`)."""
    lines = output.splitlines()
    return {m.group(1): i for i, line in enumerate(lines)
            if (m := re.search(r"\| (\S+) stopped \(rc=", line))}


# Ctrl-C (what a user of `make run` does) in `make test`; SIGTERM and a hang-up, the same drain
# reached by other signals, in `make test-long` (~30 s each since the model's batches of 64;
# ~80 s each with batches of 8, when they moved there to keep `make test` in its budget).
@pytest.mark.parametrize("how", [how if how == "ctrl-c" else
                                 pytest.param(how, marks=pytest.mark.long) for how in HOW])
def test_a_stop_under_load_drains_in_order_and_runs_no_job_twice(tmp_path, how):
    log = tmp_path / "runs.log"
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump(slow_model(log)))
    env = run_env(tmp_path, IQ_MODELS_FILE=str(models))
    api = f"http://127.0.0.1:{env['IQ_PORT']}"
    sig, group = HOW[how]
    first, load = MakeRun(env, tmp_path / "first.log"), None
    try:
        first.wait_up(180)
        app = redis.Redis(port=int(env["REDIS_PORT"]), decode_responses=True,
                          username="iq", password=secret(env, "redis-app-password"))
        load = Load(api, "slow", how, clients=4, pause_s=0.1).start()

        def busy() -> bool:  # a batch running, with batches done before it
            statuses = job_statuses(app, list(load.accepted.values())).values()
            return "running" in statuses and sum(runs(log).values()) >= 8

        wait_until(busy, 120, "a batch running under load")
        began = time.monotonic()
        code = first.stop(sig, group=group)
        took = time.monotonic() - began
    finally:
        left, busy_ports = first.left_behind(), first.ports_in_use()
        first.reap()
    output = first.output()
    print(f"make run stopped by {how} under load in {took:.1f}s")
    assert code is not None, output[-3000:]
    assert "SIGKILL" not in output, (took, output[-3000:])
    assert took < STOP_S, (took, output[-3000:])
    assert left == [] and busy_ports == []
    seen = stopped_lines(output)
    assert seen["redis"] > max(seen["worker"], seen["web"], seen["webhooks"], seen["flower"])

    each_job_once_after_a_restart(env, tmp_path, load, app, log, at_least=8)


def test_every_process_leaves_on_sigterm_with_its_redis_frozen(tmp_path):
    """The worker, the deliverer, Flower and the API, each signalled as make run signals it
    (SIGTERM to its process group) while their Redis is frozen: every call of their stop
    waits out its socket timeout. Each is gone within the stop timeout and its last resort:
    the worker, the deliverer and Flower stayed for minutes."""
    stack = launch(tmp_path, {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}},
                   {"w": ["quick"]}, defaults=True)
    parts = {"worker": stack.workers["w"], "web": stack.web}
    frozen = False
    try:
        parts["webhooks"] = start_webhooks("stop", stack.env, tmp_path)
        port = free_port()  # Flower as make run starts it: scripts/flower.sh
        parts["flower"] = spawn("flower", [str(ROOT / "scripts" / "flower.sh")],
                                dict(stack.env, FLOWER_PORT=str(port),
                                     FLOWER_BASIC_AUTH="admin:" + secrets.token_hex(8)),
                                tmp_path)
        wait_until(lambda: requests.get(f"http://127.0.0.1:{port}/healthcheck", timeout=2).ok,
                   120, "Flower up")
        # Frozen once the deliverer consumes (its metrics are served before it connects: a
        # freeze during its start met no lease renewal, and it logged nothing of it in 60 s).
        hooks = parts["webhooks"]
        hooks.wait_ready(lambda: re.search(r" stop@\S+ ready\.", hooks.log.read_text()), 120,
                         "the deliverer consuming")
        os.kill(stack.redis_svc.proc.pid, signal.SIGSTOP)
        frozen = True
        # Stopped once they have met the freeze (the deliverer's lease renewal timed out),
        # as an operator's stop meets it.
        wait_until(lambda: "Timeout reading from socket" in hooks.log.read_text(), 60,
                   "the deliverer to meet the freeze")
        began = time.monotonic()
        for part in parts.values():
            part.send(signal.SIGTERM)
        gone: dict[str, float] = {}

        def all_gone() -> bool:
            gone.update({name: time.monotonic() - began for name, part in parts.items()
                         if name not in gone and part.proc.poll() is not None})
            return len(gone) == len(parts)

        bound = STOP_S + LAST_RESORT_S + 1
        try:
            wait_until(all_gone, bound + 10, "every part gone")
        except TimeoutError:
            pass
        assert set(gone) == set(parts) and max(gone.values()) < bound, gone
    finally:
        if frozen:
            os.kill(stack.redis_svc.proc.pid, signal.SIGCONT)
        for part in parts.values():
            part.stop()
        stack.stop()


def make_runs_redis(run: MakeRun) -> psutil.Process:
    """The redis-server make run started (its keeper and script above it)."""
    servers = [p for p in run.processes() if "redis-server" in p.name()]
    assert len(servers) == 1, servers
    return servers[0]


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# In `make test-long` (two make runs, ~40 s here); `make test` keeps each process's stop with
# its Redis frozen (above) and make run's stop under load by Ctrl-C.
@pytest.mark.long
def test_a_stop_under_load_with_redis_frozen_goes_in_order_and_kills_nothing(tmp_path):
    log = tmp_path / "runs.log"
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump(slow_model(log)))
    env = run_env(tmp_path, IQ_MODELS_FILE=str(models))
    api = f"http://127.0.0.1:{env['IQ_PORT']}"
    first, load, server = MakeRun(env, tmp_path / "first.log"), None, None
    try:
        first.wait_up(180)
        app = redis.Redis(port=int(env["REDIS_PORT"]), decode_responses=True,
                          username="iq", password=secret(env, "redis-app-password"))
        load = Load(api, "slow", "frozen", clients=4, pause_s=0.1).start()
        wait_until(lambda: sum(runs(log).values()) >= 8, 120, "batches done under load")
        server = make_runs_redis(first)
        server.suspend()  # an operator's mistake: SIGSTOP to Redis
        began = time.monotonic()
        code = first.stop(signal.SIGINT)
        took = time.monotonic() - began
    finally:
        left, busy_ports = first.left_behind(), first.ports_in_use()
        first.reap()
    output = first.output()
    print(f"make run stopped with its Redis frozen under load in {took:.1f}s")
    assert code is not None, output[-3000:]
    assert "SIGKILL" not in output, (took, output[-3000:])
    assert took < STOP_S + 5, (took, output[-3000:])
    assert left == [] and busy_ports == []
    assert gone(server), server  # it was not left frozen: shut down, or killed
    lines = output.splitlines()
    sent = {m.group(2): i for i, line in enumerate(lines)
            if (m := re.search(r"sending (SIG\w+) to (\S+) ", line)) and m.group(1) == "SIGTERM"}
    seen = stopped_lines(output)
    # Redis is woken first, so that the running batch stores its results; the deliverer and
    # Flower are told in the first step, with the API and the worker (before either has gone);
    # Redis is told last.
    cont = next(i for i, line in enumerate(lines) if "sending SIGCONT to redis " in line)
    assert cont < min(sent.values())
    assert max(sent["webhooks"], sent["flower"]) < min(seen["worker"], seen["web"])
    assert max(seen["webhooks"], seen["flower"], seen["worker"], seen["web"]) < sent["redis"]
    assert seen["redis"] > max(seen["webhooks"], seen["flower"], seen["web"])

    each_job_once_after_a_restart(env, tmp_path, load, app, log)


def each_job_once_after_a_restart(env: dict, tmp_path: Path, load: Load, app, log: Path,
                                  at_least: int = 1) -> None:
    """A second make run finishes every job the first accepted (clients resending through
    the stop are answered by it), each run once by its record's `runs` and the model's log;
    then it stops by Ctrl-C, killing nothing and leaving nothing."""
    second = MakeRun(env, tmp_path / "second.log")
    try:
        second.wait_up(180)
        load.stop()
        accepted = list(load.accepted.values())
        assert len(accepted) >= at_least
        wait_until(lambda: set(job_statuses(app, accepted).values()) == {"succeeded"}, 300,
                   "every accepted job succeeded")
        records = fields_of(app, accepted)
        twice = {job_id: r["runs"] for job_id, r in records.items() if r.get("runs") != "1"}
        assert twice == {}
        ran = runs(log)
        assert {text: ran[text] for text in load.accepted if ran[text] != 1} == {}
        print(f"{len(accepted)} jobs accepted, each ran once")
    finally:
        second.stop(signal.SIGINT)
        left, busy_ports = second.left_behind(), second.ports_in_use()
        second.reap()
        load._stop.set()
    assert "SIGKILL" not in second.output()
    assert left == [] and busy_ports == []


def test_a_stop_during_the_apis_hand_over_ends_in_time_and_kills_nothing(tmp_path):
    """Ctrl-C while the API's gunicorn hands over to new processes not yet up (a models
    reload's SIGHUP, tests/integration/test_api_sighup.py; the new processes held, as a loaded
    host holds them importing the app, until the old ones are gone): the stop ends within
    IQ_STOP_TIMEOUT_S, nothing killed, no process left."""
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": {"quick": {"kind": "synthetic"}}}))
    env = run_env(tmp_path, IQ_MODELS_FILE=str(models), IQ_WEB_WORKERS="2")
    first, new = MakeRun(env, tmp_path / "first.log"), set()

    def children(master: psutil.Process) -> set[int]:
        return {p.pid for p in master.children()}

    try:
        first.wait_up(180)
        master = next(p for p in first.processes() if "gunicorn" in " ".join(p.cmdline())
                      and "gunicorn" not in " ".join(p.parent().cmdline()))
        wait_until(lambda: len(children(master)) == 2, 60, "two API processes")
        old = children(master)
        os.kill(master.pid, signal.SIGHUP)
        wait_until(lambda: len(children(master) - old) == 2, 30, "the new processes forked")
        new = children(master) - old
        for pid in new:
            os.kill(pid, signal.SIGSTOP)

        def release() -> None:  # the new processes go on once the old ones are gone
            try:
                wait_until(lambda: not children(master) & old, 2 * STOP_S, "old ones gone")
            except (TimeoutError, psutil.NoSuchProcess):
                pass
            resume(new)

        releaser = threading.Thread(target=release, daemon=True)
        releaser.start()
        began = time.monotonic()
        code = first.stop(signal.SIGINT, group=True)
        took = time.monotonic() - began
    finally:
        resume(new)
        left = first.left_behind()
        first.reap()
    output = first.output()
    print(f"make run stopped by ctrl-c during the API's hand-over in {took:.1f}s")
    assert code is not None and "SIGKILL" not in output, (took, output[-3000:])
    assert took < STOP_S, (took, output[-3000:])
    assert left == []
