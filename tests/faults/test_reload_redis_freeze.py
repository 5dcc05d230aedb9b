"""A Redis freeze (SIGSTOP, then SIGCONT) of longer than the heartbeat's TTL in the middle of a
good reload, on the default settings, under load, runs counted per job: the reload is done,
not refused. Every consuming entry has lapsed by the time Redis answers again; `make reload`
once read the worker as gone at its first look after the freeze, before the worker could
renew its heartbeat, and refused the reload and undid it although the worker was taking it.
A lapse within `heartbeat_ttl_s` of a stall is awaited now (scripts/reload_wait.py `Stall`),
within the reload's deadline.

The worker's new child is held loading (the synthetic model's `load_gate`) so that the freeze
falls inside its reload, and the worker's main process is held (SIGSTOP) from the freeze until
`make reload` has looked after it, so that its heartbeat comes after that look, as it may
when its own calls to Redis are still backing off."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import orjson
import pytest
import redis
import yaml

from scripts.stack import ROOT, launch, start_redis, start_worker, wait_until
from tasks.keys import RELOAD_STATUS_KEY
from tests.faults.test_reload_gate import check_every_job
from tests.support.load import Load

pytestmark = pytest.mark.slow

FREEZE_S = 12.0  # past heartbeat_ttl_s (10 s by default): every entry lapses


def worker_state(client) -> dict:
    for name, raw in client.hgetall(RELOAD_STATUS_KEY).items():
        if name.startswith("worker:"):
            return orjson.loads(raw)
    return {}


class Output:
    """make reload's lines as it prints them, each with when it came."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def since(self, at: float) -> list[str]:
        return [line for when, line in self.lines if when >= at]

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


# The group's Redis in `make test-long` (the same freeze in a reload, ~50 s here).
@pytest.mark.parametrize("where", ["default", pytest.param("group", marks=pytest.mark.long)])
def test_a_redis_freeze_in_a_good_reload_is_waited_out_not_refused(tmp_path, where):
    """`default`: REDIS_URL's Redis frozen, where the API processes watch too (their canary
    of the file, reaching that Redis, is tried again rather than refused). `group`: the Redis
    of group g, with a worker of its own, frozen; no API process watches it, so its lapsed
    worker alone once settled the reload there: refused and undone."""
    gate = tmp_path / "load-gate"
    held = {"kind": "synthetic", "base_ms": 20, "per_item_ms": 0, "max_batch_size": 4,
            "runs_log": str(tmp_path / "held.log"), "load_gate": str(gate)}
    group = None
    if where == "group":
        (tmp_path / "g").mkdir()
        group = start_redis(tmp_path / "g")
        held["redis"] = "g"
    stack = launch(tmp_path, {"held": held}, {} if group else {"a": None},
                   {"IQ_REDIS_GROUPS": f"g={group.extra['url']}"} if group else {},
                   defaults=True, ready_models=[] if group else None)
    frozen_redis = group or stack.redis_svc
    on_it = redis.Redis.from_url(frozen_redis.extra["url"], decode_responses=True)
    load, proc = None, None
    try:
        if group:
            stack.workers["a"] = start_worker(
                "a", dict(stack.env, REDIS_URL=group.extra["url"]), tmp_path, None)
            stack.wait_live(["held"], 180)
        worker = stack.workers["a"].proc.pid
        load = Load(stack.api, "held", "h", clients=2, pause_s=0.1).start()
        wait_until(lambda: len(load.accepted) > 10, 60, "the load to run")
        gate.touch()  # the reload's new child waits loading until it goes
        new = tmp_path / "new.yaml"
        new.write_text(yaml.safe_dump({"models": {"held": {**held, "version": "2"}}}))
        proc = subprocess.Popen([sys.executable, "-m", "scripts.reload", str(new), "--timeout",
                                 "120"], cwd=ROOT, env=stack.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        out = Output(proc)
        wait_until(lambda: worker_state(on_it).get("state") == "reloading", 60,
                   "the worker's reload to begin")
        os.kill(worker, signal.SIGSTOP)
        os.kill(frozen_redis.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(FREEZE_S)  # the fault itself: Redis frozen this long
        finally:
            os.kill(frozen_redis.proc.pid, signal.SIGCONT)
        back = time.monotonic()
        try:  # make reload looks (and says what it sees of the worker) before the worker
            wait_until(lambda: proc.poll() is not None or any(
                "worker:a@" in line for line in out.since(back)), 60,
                "make reload's first look at the worker after the freeze")
        finally:
            os.kill(worker, signal.SIGCONT)
        gate.unlink()
        proc.wait(timeout=180)
        out.thread.join(10)
        assert proc.returncode == 0, out.text()
        assert "reload done" in out.text() and "gone" not in out.text(), out.text()
        assert "heartbeat lapsed while Redis did not answer; awaited" in out.text(), out.text()
        wait_until(lambda: len(load.accepted) > 40, 120, "jobs after the freeze")
        load.stop()
        check_every_job(stack, load, tmp_path / "held.log", on_it)
    except BaseException:
        if proc is not None and proc.poll() is None:
            proc.kill()
        print(stack.logs())
        raise
    finally:
        if "a" in stack.workers:
            os.kill(stack.workers["a"].proc.pid, signal.SIGCONT)
        if load is not None:
            load.stop()
        stack.stop()
        if group is not None:
            group.stop()
