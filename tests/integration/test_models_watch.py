"""An API process's side of a models reload (app/reloading.py) on a real Redis: its gunicorn
master gets one SIGHUP per reload, whichever of its processes sees the announcement first,
also for a reload back to a revision it served before; none when the new file's canary
(app/canary.py) cannot start, the process then refusing the revision until it is announced
again."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import orjson
import pytest
import redis

import app.reloading
from app.reloading import ModelsWatch
from config import load_settings
from config.models import revision_of
from scripts.stack import ROOT, wait_until
from tasks.keys import (MODELS_ANNOUNCEMENTS_KEY, MODELS_REVISION_KEY, RELOAD_STATUS_KEY,
                        reload_failed_key)
from tasks.reload_failures import failure_of

# A stand-in for gunicorn's master: it counts the SIGHUPs it gets, from the moment it says its
# handler is set. Python, as gunicorn, sets its handler over a SIGHUP the test run was started
# with ignored (under nohup), which a shell's trap cannot.
STAND_IN = """
import pathlib, signal, sys
hups = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGHUP, lambda *_: hups.open("a").write("hup\\n"))
pathlib.Path(sys.argv[2]).touch()
while True:
    signal.pause()
"""


def serves(client, models: bytes, node: str = "w@h") -> None:
    """A worker's report (workers/batching/reload.py): it serves `models`."""
    client.hset(RELOAD_STATUS_KEY, f"worker:{node}", orjson.dumps(
        {"revision": revision_of(models), "state": "serving", "at": time.time()}))


@contextmanager
def live(client, models: bytes):
    """A live worker serving `models`: its report renewed as its heartbeat renews it, while a
    canary runs (on a loaded machine one took longer than a report lives: 5 heartbeats)."""
    stop = threading.Event()
    serves(client, models)  # live from the start, not from the thread's first turn

    def beat() -> None:
        while not stop.wait(0.5):
            serves(client, models)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_a_master_gets_one_sighup_per_reload_also_back_to_a_revision_it_served(
        redis_server, tmp_path, monkeypatch):
    redis.Redis.from_url(redis_server.extra["admin_url"]).flushdb()
    client = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    hups, ready = tmp_path / "hups", tmp_path / "ready"
    master = subprocess.Popen([sys.executable, "-c", STAND_IN, str(hups), str(ready)])
    wait_until(ready.exists, 30, "the stand-in master's handler")
    # Every signal the watches send, recorded as it goes through: two SIGHUPs sent close
    # together reach a process as one (a signal pending once), so only the sends count them.
    sent: list[tuple[int, int]] = []
    real_kill = os.kill

    def kill(pid: int, sig: int) -> None:
        sent.append((pid, sig))
        real_kill(pid, sig)

    monkeypatch.setattr(app.reloading.os, "kill", kill)
    models = tmp_path / "models.yaml"
    a, b = b"models: {a: {kind: synthetic}}\n", b"models: {b: {kind: synthetic}}\n"
    settings = load_settings({"redis_url": redis_server.extra["url"],
                              "models_file": str(models)})
    # Each watch's canary (app/canary.py) builds the app in a process of its own, from this
    # process's environment, as an API process's does from gunicorn's.
    monkeypatch.setenv("REDIS_URL", redis_server.extra["url"])
    monkeypatch.setenv("IQ_MODELS_FILE", str(models))

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
            with live(client, target):  # a canary may take longer than a report lives
                for watch in watches:
                    watch.check()
            assert all(watch.handed_over for watch in watches)
            serving = target  # the processes that replace them serve the new file
            assert sent == [(master.pid, app.reloading.signal.SIGHUP)] * reloads, sent
            wait_until(lambda: received() == reloads, 10, f"SIGHUP {reloads} to arrive")
        assert master.poll() is None  # it took them all, alive
    finally:
        master.kill()
        master.wait()


def test_a_file_whose_canary_cannot_start_leaves_the_master_alone_and_is_refused(
        redis_server, tmp_path, monkeypatch):
    """A file that moves a model to a Redis group whose Redis does not answer (configured,
    but down): the canary, built with the process's own environment, cannot reach it, so the
    master gets no SIGHUP (its new processes would not have booted, and it would have exited),
    the process keeps serving the old revision and reports the refusal with the canary's
    reason, recording it as a failed load is recorded; it tries again only when the revision is
    announced again."""
    redis.Redis.from_url(redis_server.extra["admin_url"]).flushdb()
    client = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    models = tmp_path / "models.yaml"
    old, new = b"models: {a: {kind: synthetic}}\n", b"models: {a: {kind: synthetic, redis: gpu}}\n"
    models.write_bytes(new)
    for name, value in {"REDIS_URL": redis_server.extra["url"], "IQ_MODELS_FILE": str(models),
                        "IQ_REDIS_GROUPS": "gpu=redis://127.0.0.1:1/0"}.items():
        monkeypatch.setenv(name, value)
    settings = load_settings()
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(app.reloading.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    canaries: list[str] = []

    def canary(revision: str) -> str:
        canaries.append(revision)
        return app.reloading.canary.run(revision)

    watch = ModelsWatch(client, settings, revision_of(old), master=os.getpid(), canary=canary)
    client.set(MODELS_REVISION_KEY, revision_of(new))
    client.incr(MODELS_ANNOUNCEMENTS_KEY)
    watch.check()
    assert sent == [] and not watch.handed_over
    report = orjson.loads(client.hget(RELOAD_STATUS_KEY, watch.field))
    assert (report["revision"], report["state"], report["refused"]) == \
        (revision_of(old), "refused", revision_of(new)), report
    assert "its canary: RuntimeError: Redis group 'gpu' did not answer" in report["error"]
    assert report["groups"] == ["gpu"]
    # Recorded as a pool child's failed load: the roll halts, the workers roll back.
    failure = failure_of(client, revision_of(new))
    assert failure["worker"] == watch.field and failure["error"].startswith(
        "its canary: RuntimeError: Redis group 'gpu' did not answer"), failure
    watch.check()  # the same announcement: not tried again
    assert canaries == [revision_of(new)]
    client.incr(MODELS_ANNOUNCEMENTS_KEY)  # announced again: tried again
    watch.check()
    assert canaries == [revision_of(new)] * 2 and sent == []


def test_an_api_process_takes_a_file_only_once_every_worker_serves_it(
        redis_server, tmp_path, monkeypatch):
    """Its canary started, the process still waits (a look each heartbeat, the canary not run
    again) while a live worker on its Redis serves the old revision, so that it never accepts
    a job for a model no worker serves yet nor refuses one the workers still serve; it hands
    over once every live worker serves the new one. A worker that refused the revision makes
    it refuse it too, with no SIGHUP: the reload is undone, the old file stays served."""
    redis.Redis.from_url(redis_server.extra["admin_url"]).flushdb()
    client = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    models = tmp_path / "models.yaml"
    old, new = b"models: {a: {kind: synthetic}}\n", b"models: {b: {kind: synthetic}}\n"
    models.write_bytes(new)
    settings = load_settings({"redis_url": redis_server.extra["url"],
                              "models_file": str(models)})
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(app.reloading.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    canaries: list[str] = []
    watch = ModelsWatch(client, settings, revision_of(old), master=os.getpid(),
                        canary=lambda revision: canaries.append(revision) or "")

    def worker(node: str, revision: bytes, state: str = "serving", **more) -> None:
        client.hset(RELOAD_STATUS_KEY, f"worker:{node}", orjson.dumps(
            {"revision": revision_of(revision), "state": state, "at": time.time(), **more}))

    worker("a@h", old)
    worker("b@h", old, "reloading")
    client.set(MODELS_REVISION_KEY, revision_of(new))
    number = str(client.incr(MODELS_ANNOUNCEMENTS_KEY))
    watch.check()
    watch.check()
    assert sent == [] and not watch.handed_over and canaries == [revision_of(new)]
    report = orjson.loads(client.hget(RELOAD_STATUS_KEY, watch.field))
    assert (report["revision"], report["state"], report["workers_pending"]) == (
        revision_of(old), "waiting for the workers", "worker:a@h, worker:b@h"), report
    worker("a@h", new)
    worker("b@h", new, "reloading")
    watch.check()
    assert sent == [] and not watch.handed_over
    worker("b@h", new)
    worker("gone@h", old)
    client.hset(RELOAD_STATUS_KEY, "worker:gone@h", orjson.dumps(  # lapsed: not waited for
        {"revision": revision_of(old), "state": "serving", "at": time.time() - 3600}))
    watch.check()
    assert sent == [(os.getpid(), app.reloading.signal.SIGHUP)] and watch.handed_over

    # Another process of an API, a newer file that a worker refused: no SIGHUP, refused.
    newer = b"models: {c: {kind: synthetic}}\n"
    models.write_bytes(newer)
    sent.clear()
    watch = ModelsWatch(client, settings, revision_of(new), master=os.getpid(),
                        canary=lambda revision: "")
    client.set(MODELS_REVISION_KEY, revision_of(newer))
    number = str(client.incr(MODELS_ANNOUNCEMENTS_KEY))
    worker("a@h", new, "refused", refused=revision_of(newer), announcement=number,
           error="its file differs")
    worker("b@h", newer)
    watch.check()
    assert sent == [] and not watch.handed_over
    report = orjson.loads(client.hget(RELOAD_STATUS_KEY, watch.field))
    assert (report["revision"], report["state"], report["refused"]) == (
        revision_of(new), "refused", revision_of(newer)), report
    assert "worker:a@h: its file differs" in report["error"]
    # The undo announces the revision it serves: it serves on, refusing nothing.
    client.set(MODELS_REVISION_KEY, revision_of(new))
    watch.check()
    report = orjson.loads(client.hget(RELOAD_STATUS_KEY, watch.field))
    assert (report["state"], report["error"], sent) == ("serving", "", [])


def test_a_revision_announced_again_after_its_rollback_sends_its_master_another_sighup(
        redis_server, tmp_path, monkeypatch):
    """Revision A announced: its master is sent a SIGHUP; A rolled back (the old revision O
    announced), and a process the SIGHUP started read the file after the rollback, so it
    serves O; A announced again: that process's master must be sent a SIGHUP again, else the
    process hands over for ever with none to come (a CI failure: "pending: handing over" for
    120 s). The claim is per announcement, not per revision."""
    redis.Redis.from_url(redis_server.extra["admin_url"]).flushdb()
    client = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(app.reloading.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    models = tmp_path / "models.yaml"
    old, new = b"models: {a: {kind: synthetic}}\n", b"models: {b: {kind: synthetic}}\n"
    settings = load_settings({"redis_url": redis_server.extra["url"],
                              "models_file": str(models)})
    hup = [(4242, app.reloading.signal.SIGHUP)]

    def announce(contents: bytes) -> None:
        models.write_bytes(contents)
        client.set(MODELS_REVISION_KEY, revision_of(contents))
        client.incr(MODELS_ANNOUNCEMENTS_KEY)
        serves(client, contents)

    def process(serving: bytes) -> ModelsWatch:  # a canary that starts
        return ModelsWatch(client, settings, revision_of(serving), 4242, canary=lambda _: "")

    before = [process(old), process(old)]
    announce(new)
    for watch in before:
        watch.check()
    assert all(watch.handed_over for watch in before) and sent == hup
    # The SIGHUP's new process reads the file after A's rollback: it serves O.
    announce(old)
    started = process(old)
    started.check()
    assert not started.handed_over
    announce(new)  # A again
    started.check()
    assert started.handed_over and sent == hup * 2, sent
    # A process that read its file after that SIGHUP, the same announcement still out (its
    # master started it, it read the file before A was installed again): its own SIGHUP.
    models.write_bytes(old)
    late = process(old)
    models.write_bytes(new)
    late.check()
    assert late.handed_over and sent == hup * 3, sent
    # Its sibling, started before that SIGHUP: the same SIGHUP replaces it, none more.
    sibling = ModelsWatch(client, settings, revision_of(old), 4242, canary=lambda _: "",
                          started=late.started)
    sibling.check()
    assert sibling.handed_over and sent == hup * 3, sent


def test_an_api_process_with_no_worker_to_ask_waits_and_a_groups_model_waits_for_its_workers(
        redis_server, tmp_path, monkeypatch):
    """No worker reports at all (none runs, or none consumes yet): the process does not take
    the file for want of one to ask (it once did, and accepted jobs no worker could serve).
    A model on a Redis group: the process waits for the workers that report on that group's
    Redis, not only REDIS_URL's, and refuses the file when one of them refused it."""
    redis.Redis.from_url(redis_server.extra["admin_url"]).flushdb()
    group_url = redis_server.extra["url"].rsplit("/", 1)[0] + "/1"
    redis.Redis.from_url(redis_server.extra["admin_url"].rsplit("/", 1)[0] + "/1").flushdb()
    client = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    group = redis.Redis.from_url(group_url, decode_responses=True)
    models = tmp_path / "models.yaml"
    old = b"models: {a: {kind: synthetic}}\n"
    new = b"models: {a: {kind: synthetic}, g: {kind: synthetic, redis: gpu}}\n"
    models.write_bytes(new)
    settings = load_settings({"redis_url": redis_server.extra["url"], "models_file": str(models),
                              "redis_groups": f"gpu={group_url}"}, environ={})
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(app.reloading.os, "kill", lambda pid, sig: sent.append((pid, sig)))

    def watch() -> ModelsWatch:
        return ModelsWatch(client, settings, revision_of(old), master=os.getpid(),
                           canary=lambda revision: "", groups={"gpu": group})

    def pending(process: ModelsWatch) -> str:
        return orjson.loads(client.hget(RELOAD_STATUS_KEY, process.field))["workers_pending"]

    for redis_of in (client, group):  # as make reload announces: the group's first
        redis_of.set(MODELS_REVISION_KEY, revision_of(new))
        redis_of.incr(MODELS_ANNOUNCEMENTS_KEY)
    process = watch()
    process.check()
    assert sent == [] and not process.handed_over
    assert pending(process) == (
        "a worker on REDIS_URL's Redis (none reports: none runs, or none consumes yet), "
        "a worker on group gpu's Redis (none reports: none runs, or none consumes yet)")
    serves(client, new)
    serves(group, old, "g@h")
    process.check()
    assert sent == [] and pending(process) == "worker:g@h (group gpu)"
    serves(group, new, "g@h")
    process.check()
    assert sent == [(os.getpid(), app.reloading.signal.SIGHUP)] and process.handed_over

    # A group's worker that refused the file: the process refuses it too, no SIGHUP.
    sent.clear()
    number = group.incr(MODELS_ANNOUNCEMENTS_KEY)
    group.hset(RELOAD_STATUS_KEY, "worker:g@h", orjson.dumps(
        {"revision": revision_of(old), "state": "refused", "at": time.time(),
         "refused": revision_of(new), "announcement": str(number), "error": "no GPU here"}))
    client.incr(MODELS_ANNOUNCEMENTS_KEY)
    process = watch()
    process.check()
    report = orjson.loads(client.hget(RELOAD_STATUS_KEY, process.field))
    assert sent == [] and report["state"] == "refused", report
    assert "worker:g@h (group gpu): no GPU here" in report["error"], report


def test_a_canary_that_cannot_reach_redis_url_is_tried_again_not_refused(
        redis_server, tmp_path, monkeypatch):
    """REDIS_URL's Redis not answering the canary (frozen, away for a while) is no fault of
    the file: the process neither refuses it nor records a failed load (a Redis freeze during
    a good reload once had it refused and undone); it tries the canary again at its next
    heartbeat, and takes the file once it starts. A group's Redis not answering is still a
    refusal (above)."""
    redis.Redis.from_url(redis_server.extra["admin_url"]).flushdb()
    client = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    models = tmp_path / "models.yaml"
    old, new = b"models: {a: {kind: synthetic}}\n", b"models: {b: {kind: synthetic}}\n"
    models.write_bytes(new)
    monkeypatch.setenv("IQ_MODELS_FILE", str(models))
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # the canary's: no answer
    settings = load_settings({"redis_url": redis_server.extra["url"],
                              "models_file": str(models)}, environ={})
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(app.reloading.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    watch = ModelsWatch(client, settings, revision_of(old), master=os.getpid())
    client.set(MODELS_REVISION_KEY, revision_of(new))
    client.incr(MODELS_ANNOUNCEMENTS_KEY)
    serves(client, new)
    with pytest.raises(redis.ConnectionError, match="REDIS_URL's Redis did not answer"):
        watch.check()
    assert not watch.handed_over and watch.refused is None and sent == []
    assert failure_of(client, revision_of(new)) is None
    monkeypatch.setenv("REDIS_URL", redis_server.extra["url"])  # it answers again
    with live(client, new):
        watch.check()
    assert watch.handed_over and sent == [(os.getpid(), app.reloading.signal.SIGHUP)]


def test_a_reload_whose_web_server_code_on_disk_does_not_load_is_refused(
        redis_server, tmp_path, monkeypatch):
    """A good models file, but web/ on disk half-deployed: gunicorn's master, reading
    gunicorn.conf.py and importing web/ anew at the SIGHUP, would exit and take the API down.
    The canary (app.canary.run) checks what the master reads, in the process's own folder
    (here a copy of gunicorn.conf.py and web/, the rest of the service on PYTHONPATH behind
    it): the reload is refused as a failed app canary refuses it, the master left alone; with
    the copy mended, the same reload is taken."""
    redis.Redis.from_url(redis_server.extra["admin_url"]).flushdb()
    client = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    served = tmp_path / "served"
    shutil.copytree(ROOT / "web", served / "web", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "gunicorn.conf.py", served / "gunicorn.conf.py")
    answer = served / "web" / "answer.py"
    good = answer.read_text()
    answer.write_text(good + "\ndef broken(:\n")
    models = tmp_path / "models.yaml"
    old, new = b"models: {a: {kind: synthetic}}\n", b"models: {b: {kind: synthetic}}\n"
    models.write_bytes(new)
    for name, value in {"REDIS_URL": redis_server.extra["url"], "IQ_MODELS_FILE": str(models),
                        "PYTHONPATH": str(ROOT)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(served)
    settings = load_settings()
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(app.reloading.os, "kill", lambda pid, sig: sent.append((pid, sig)))

    why = app.reloading.canary.run(revision_of(new))
    assert why.startswith("the web server's code on disk: web/answer.py does not load: "
                          "SyntaxError: "), why
    watch = ModelsWatch(client, settings, revision_of(old), master=os.getpid())
    client.set(MODELS_REVISION_KEY, revision_of(new))
    client.incr(MODELS_ANNOUNCEMENTS_KEY)
    serves(client, new)
    watch.check()
    assert sent == [] and not watch.handed_over
    report = orjson.loads(client.hget(RELOAD_STATUS_KEY, watch.field))
    assert (report["revision"], report["state"], report["refused"]) == \
        (revision_of(old), "refused", revision_of(new)), report
    assert f"(its canary: {why})" in report["error"], report
    assert failure_of(client, revision_of(new))["error"] == f"its canary: {why}"

    # The deploy finished, the file announced again (`make reload` clears its failure): taken.
    answer.write_text(good)
    client.delete(reload_failed_key(revision_of(new)))
    client.incr(MODELS_ANNOUNCEMENTS_KEY)
    with live(client, new):
        watch.check()
    assert watch.handed_over and sent == [(os.getpid(), app.reloading.signal.SIGHUP)]
