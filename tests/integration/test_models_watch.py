"""An API process's side of a models reload (app/reloading.py) on a real Redis: its gunicorn
master gets one SIGHUP per reload, whichever of its processes sees the announcement first,
also for a reload back to a revision it served before."""
from __future__ import annotations

import signal
import subprocess
import time

import redis

from app.reloading import ModelsWatch
from config import load_settings
from config.models import revision_of
from scripts.stack import wait_until
from tasks.keys import MODELS_REVISION_KEY


def test_a_master_gets_one_sighup_per_reload_also_back_to_a_revision_it_served(
        redis_server, tmp_path):
    redis.Redis.from_url(redis_server.extra["admin_url"]).flushdb()
    client = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    hups, trapping = tmp_path / "hups", tmp_path / "trapping"
    # A stand-in for gunicorn's master: it counts the SIGHUPs it gets, from the moment it says
    # its trap is set (a SIGHUP before that kills it). SIGHUP as a terminal's session leaves
    # it: a test run under nohup passes it on ignored, and bash cannot trap a signal ignored
    # when it starts (0 SIGHUPs counted).
    master = subprocess.Popen(["bash", "-c", f"trap 'echo hup >> {hups}' HUP; "
                               f"touch {trapping}; while :; do sleep 0.05; done"],
                              preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    wait_until(trapping.exists, 30, "the stand-in master's trap")
    models = tmp_path / "models.yaml"
    a, b = b"models: {a: {kind: synthetic}}\n", b"models: {b: {kind: synthetic}}\n"
    settings = load_settings({"redis_url": redis_server.extra["url"],
                              "models_file": str(models)})

    def received() -> int:
        return len(hups.read_text().split()) if hups.exists() else 0

    try:
        serving = a
        for reloads, target in enumerate((b, a, b), start=1):
            models.write_bytes(target)
            client.set(MODELS_REVISION_KEY, revision_of(target))
            # Two processes of the master see the announcement: one SIGHUP between them.
            watches = [ModelsWatch(client, settings, revision_of(serving), master.pid)
                       for _ in range(2)]
            for watch in watches:
                watch.check()
            assert all(watch.handed_over for watch in watches)
            serving = target  # the processes that replace them serve the new file
            deadline = time.monotonic() + 5
            while received() < reloads and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
            assert received() == reloads, f"{received()} SIGHUPs for {reloads} reloads"
            assert master.poll() is None  # it counted them, alive
    finally:
        master.kill()
        master.wait()
