"""`make reload --timeout` bounds a stall, not the whole roll (scripts/reload.py): workers that
reload in turn (workers/batching/turns.py) take a model load each, so a reload that keeps moving on
waits past its timeout, and one where nothing moves on gives up after it, even while a
worker's status keeps changing, saying where each process stands; a failed load a worker
recorded refuses it at once. A file the running processes cannot serve (a Redis group only the
operator's shell has, a GPU model for a worker without one) is refused before anything
changes; the reload is done only once every gunicorn runs as many processes on the new
revision as it runs. A worker or API process here is its report in Redis, written by the test
as its tick would."""
from __future__ import annotations

import threading
import time

import orjson
import pytest
import redis
import yaml

from config import load_settings
from config.models import revision_of
from scripts.reload import DONE, REFUSED, TIMED_OUT, reload
from scripts.reload import INVALID
from tasks.keys import CONSUMING_KEY, MODELS_REVISION_KEY, RELOAD_API_KEY, RELOAD_STATUS_KEY, \
    reload_failed_key

MODELS = {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}


@pytest.fixture
def client(redis_server):
    admin = redis.Redis.from_url(redis_server.extra["admin_url"], decode_responses=True)
    admin.flushdb()
    return redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)


def report(client, revision: str, state: str, left: int = 0, **serves) -> None:
    client.zadd(CONSUMING_KEY, {"w@h": time.time()})
    client.hset(RELOAD_STATUS_KEY, "worker:w@h", orjson.dumps(
        {"revision": revision, "state": state, "at": time.time(), "children_left": left,
         "error": "", "refused": "", **serves}))


def setup(tmp_path, client, redis_server):
    target = tmp_path / "models.yaml"
    target.write_text(yaml.safe_dump({"models": MODELS}))
    settings = load_settings({"redis_url": redis_server.extra["url"],
                              "models_file": str(target)}, environ={})
    report(client, "old", "serving")
    return settings


def test_a_reload_where_nothing_moves_on_times_out(tmp_path, client, redis_server):
    settings = setup(tmp_path, client, redis_server)
    said: list[str] = []
    started = time.monotonic()
    result = reload(timeout_s=1.5, say=said.append, settings=settings)
    assert result.status == TIMED_OUT and time.monotonic() - started < 10
    assert "nothing moved on for 1.5s" in said[-1] and "worker:w@h" in said[-1]
    assert "worker:w@h (pending: serving (old))" in said[-1], said  # where it stands


def test_a_reload_that_keeps_moving_on_waits_past_its_timeout(tmp_path, client, redis_server):
    settings = setup(tmp_path, client, redis_server)
    said: list[str] = []

    def worker() -> None:
        """Three children replaced, one every second: each a step the reload sees."""
        revision = None
        while revision is None or revision == "old":
            revision = client.get(MODELS_REVISION_KEY)
            time.sleep(0.1)
        for left in (3, 2, 1):
            report(client, revision, "reloading", left)
            time.sleep(1.0)
        report(client, revision, "serving")

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    started = time.monotonic()
    result = reload(timeout_s=1.5, say=said.append, settings=settings)
    thread.join(10)
    assert result.status == DONE, said
    assert time.monotonic() - started > 3, "past its 1.5 s timeout: it moved on meanwhile"


def announced(client) -> str:
    revision = None
    while revision is None or revision == "old":
        revision = client.get(MODELS_REVISION_KEY)
        time.sleep(0.05)
    return revision


def test_a_worker_in_a_restart_loop_does_not_hold_the_reload_past_its_timeout(
        tmp_path, client, redis_server):
    """Its status keeps changing (reloading, then back on the old revision after a restart,
    then reloading again) but it never gets further: that is not moving on."""
    settings = setup(tmp_path, client, redis_server)
    stop = threading.Event()

    def worker() -> None:
        revision = announced(client)
        end = time.monotonic() + 12  # without the fix, the reload waits until this stops
        while not stop.is_set() and time.monotonic() < end:
            report(client, revision, "reloading", 1)
            stop.wait(0.3)
            report(client, "old", "serving")
            stop.wait(0.3)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    said: list[str] = []
    started = time.monotonic()
    try:
        result = reload(timeout_s=1.5, say=said.append, settings=settings)
    finally:
        stop.set()
        thread.join(10)
    assert result.status == TIMED_OUT and time.monotonic() - started < 8, said


def test_a_failed_load_refuses_the_reload_at_once_and_a_retry_clears_it(
        tmp_path, client, redis_server):
    """A worker's new child recorded that it could not load the revision
    (tasks/reload_failures.py): `make reload` says who and why and exits 2 without waiting for
    the workers' reports. Announcing the same file again clears it."""
    settings = setup(tmp_path, client, redis_server)
    revision = revision_of((tmp_path / "models.yaml").read_bytes())
    client.set(reload_failed_key(revision), orjson.dumps(
        {"worker": "w@h", "error": "RuntimeError: no program", "at": time.time()}))

    def worker(fails: bool) -> None:
        announced(client)
        if fails:  # the worker's report stays pending: reloading, its child loading
            report(client, revision, "reloading", 1)
            client.set(reload_failed_key(revision), orjson.dumps(
                {"worker": "w@h", "error": "RuntimeError: no program", "at": time.time()}))
        else:
            report(client, revision, "serving")

    for fails, expected in ((True, REFUSED), (False, DONE)):
        report(client, "old", "serving")
        client.delete(MODELS_REVISION_KEY)
        thread = threading.Thread(target=worker, args=(fails,), daemon=True)
        thread.start()
        said: list[str] = []
        result = reload(timeout_s=5, say=said.append, settings=settings)
        thread.join(10)
        assert result.status == expected, said
        if fails:
            assert "worker:w@h could not load it: RuntimeError: no program" in said[-1]


def test_api_processes_still_handing_over_are_waited_for_but_not_counted(
        tmp_path, client, redis_server):
    """An API process of an earlier reload still handing over when this one starts (its
    master stops it only after its replacements started) leaves before this one is done: it
    is pending until then, but the reload does not wait for as many API processes as it saw
    with it (it once waited out its whole timeout: 'API processes not back')."""
    settings = setup(tmp_path, client, redis_server)

    def api(pid: int, revision: str, state: str) -> None:
        client.hset(RELOAD_STATUS_KEY, f"api:h/{pid}", orjson.dumps(
            {"revision": revision, "state": state, "at": time.time(), "error": ""}))

    api(1, "old", "handing over")
    api(2, "old", "serving")

    def processes() -> None:
        revision = announced(client)
        api(2, "old", "handing over")
        client.hdel(RELOAD_STATUS_KEY, "api:h/1")  # the earlier one exits
        api(3, revision, "serving")
        report(client, revision, "serving")
        time.sleep(0.5)
        client.hdel(RELOAD_STATUS_KEY, "api:h/2")  # and so does the one this one replaced

    thread = threading.Thread(target=processes, daemon=True)
    thread.start()
    said: list[str] = []
    result = reload(timeout_s=3, say=said.append, settings=settings)
    thread.join(10)
    assert result.status == DONE, said
    assert "  api:h/2: pending: handing over (old)" in said, said


def test_a_failed_load_on_a_groups_redis_puts_the_previous_file_back_everywhere(
        tmp_path, client, redis_server):
    """`make reload FILE` whose new models a worker of a Redis group could not load: the file
    it replaced goes back in place and is announced on every Redis the new one was. A
    group's Redis is announced before REDIS_URL's, where the API processes watch: the group's
    failed load ends the reload before they are told of the file."""
    settings = setup(tmp_path, client, redis_server)
    group_url = redis_server.extra["url"].rsplit("/", 1)[0] + "/1"
    group = redis.Redis.from_url(group_url, decode_responses=True)
    redis.Redis.from_url(redis_server.extra["admin_url"].rsplit("/", 1)[0] + "/1").flushdb()
    report(group, "old", "serving")
    settings = load_settings({"redis_url": redis_server.extra["url"], "models_file":
                              settings.models_file, "redis_groups": f"g={group_url}"}, environ={})
    old = revision_of((tmp_path / "models.yaml").read_bytes())
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump({"models": {**MODELS, "more": MODELS["quick"]}}))
    bad = revision_of(new.read_bytes())
    stop = threading.Event()

    def workers(redis_of: redis.Redis, fails: bool) -> None:
        """Each announced revision served, but the new one fails to load on the group's."""
        while not stop.is_set():
            revision = redis_of.get(MODELS_REVISION_KEY)
            if revision == bad and fails:
                redis_of.set(reload_failed_key(bad), orjson.dumps(
                    {"worker": "w@h", "error": "RuntimeError: no program", "at": 0}))
            elif revision:
                report(redis_of, revision, "serving")
            stop.wait(0.1)

    threads = [threading.Thread(target=workers, args=(r, r is group), daemon=True)
               for r in (client, group)]
    for thread in threads:
        thread.start()
    said: list[str] = []
    try:
        result = reload(new, timeout_s=5, say=said.append, settings=settings)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert result.status == REFUSED and result.failed_load, said
    assert revision_of((tmp_path / "models.yaml").read_bytes()) == old
    assert [client.get(MODELS_REVISION_KEY), group.get(MODELS_REVISION_KEY)] == [None, old]
    assert not any(f"revision {bad} announced" in line for line in said[:said.index(
        "Redis group g:")]), said  # the group first
    assert f"every process serves revision {old}" in said[-1], said


def api(client, pid: int, revision: str, state: str = "serving", **more) -> None:
    client.hset(RELOAD_STATUS_KEY, f"api:h/{pid}", orjson.dumps(
        {"revision": revision, "state": state, "at": time.time(), "error": "", **more}))


@pytest.mark.parametrize("case", ["group", "device"])
def test_a_file_the_running_processes_cannot_serve_is_refused_and_nothing_changes(
        tmp_path, client, redis_server, case):
    """The operator's shell has IQ_REDIS_GROUPS=gpu=…, the running processes do not (they
    report the groups they have; an older process's report without them is not checked): the file moving a model there is refused, naming the field,
    before it is installed or announced; as is a GPU model for the worker without a GPU that
    would serve its queue. (Once, the shell's check passed, the file was installed, and every
    API and worker process crash-looped on it.)"""
    settings = setup(tmp_path, client, redis_server)
    group_url = redis_server.extra["url"].rsplit("/", 1)[0] + "/1"
    settings = load_settings({"redis_url": redis_server.extra["url"], "redis_groups":
                              f"gpu={group_url}", "models_file": settings.models_file},
                             environ={})
    # Their own names: an earlier test's thread may still write w@h's report.
    client.hset(RELOAD_STATUS_KEY, "worker:gpu-less@h", orjson.dumps(
        {"revision": "old", "state": "serving", "at": time.time(), "groups": [], "gpus": 0,
         "queues": ["quick"], "consumes_all": False}))
    api(client, 1, "old", groups=[])
    target = tmp_path / "models.yaml"
    before = target.read_bytes()
    new = tmp_path / "new.yaml"
    moved = {"redis": "gpu"} if case == "group" else {"device": "cuda"}
    new.write_text(yaml.safe_dump({"models": {"quick": {**MODELS["quick"], **moved}}}))
    said: list[str] = []
    result = reload(new, timeout_s=5, say=said.append, settings=settings)
    assert result.status == INVALID, said
    assert said[0].startswith("reload refused, nothing changed: "), said
    assert said[0].endswith({
        "group": "models.quick.redis: group 'gpu' is not configured in the running API/worker "
                 "processes (api:h/1, worker:gpu-less@h): add it to their IQ_REDIS_GROUPS and restart "
                 "them before a reload names it",
        "device": "models.quick.device: 'cuda', but the running worker(s) worker:gpu-less@h "
                  "that would serve queue 'quick' see no CUDA device"}[case]), said
    assert target.read_bytes() == before
    assert not (tmp_path / "models.yaml.previous").exists()
    assert client.get(MODELS_REVISION_KEY) is None  # nothing announced


def test_done_only_once_every_gunicorn_runs_its_processes_on_the_revision(
        tmp_path, client, redis_server):
    """A gunicorn of two processes whose master is restarting as the reload begins (no API
    process reports; a rollback after a reload that took the API down): the reload is done
    only once both its processes serve the revision, not as soon as the workers do. (Once,
    a rollback printed "reload done" 17 s before any API process was up.)"""
    settings = setup(tmp_path, client, redis_server)
    service = "h 127.0.0.1:8000"
    client.hset(RELOAD_API_KEY, service, orjson.dumps({"processes": 2, "at": time.time()}))
    up: list[float] = []

    def processes() -> None:
        revision = announced(client)
        report(client, revision, "serving")
        for pid in (1, 2):
            time.sleep(1.0)
            api(client, pid, revision, service=service)
            up.append(time.monotonic())

    thread = threading.Thread(target=processes, daemon=True)
    thread.start()
    said: list[str] = []
    result = reload(timeout_s=5, say=said.append, settings=settings)
    finished = time.monotonic()
    thread.join(10)
    assert result.status == DONE, said
    assert len(up) == 2 and finished >= up[1], said
    assert f"  api {service}: pending: 0 of 2 process(es) up on it" in said, said
    assert f"  api {service}: pending: 1 of 2 process(es) up on it" in said, said


def test_a_redis_that_stalls_once_the_file_is_installed_puts_the_previous_file_back(
        tmp_path, monkeypatch):
    """Redis frozen (SIGSTOP) between the install and the announcement: the file that was
    replaced goes back in place (a worker restarted by its keeper reads the file on disk, and
    would refuse a revision no running process took), the announced revision is the old one
    still, and the reload says so in one line and fails."""
    import os
    import signal

    import scripts.reload
    from scripts.redis_nodes import start_redis

    server = start_redis(tmp_path / "redis")
    try:
        client = redis.Redis.from_url(server.extra["url"], decode_responses=True)
        target = tmp_path / "models.yaml"
        old = yaml.safe_dump({"models": MODELS}).encode()
        target.write_bytes(old)
        new = tmp_path / "new.yaml"
        new.write_text(yaml.safe_dump({"models": {**MODELS, "other": MODELS["quick"]}}))
        client.set(MODELS_REVISION_KEY, revision_of(old))
        report(client, revision_of(old), "serving")
        settings = load_settings({"redis_url": server.extra["url"], "models_file": str(target),
                                  "redis_timeout_s": 1.0}, environ={})
        installed: list[str] = []
        real_install = scripts.reload.install

        def install(*args, **kwargs) -> str:
            revision = real_install(*args, **kwargs)
            if not installed:  # the new file: Redis stalls at once
                os.kill(server.proc.pid, signal.SIGSTOP)
            installed.append(revision)
            return revision

        monkeypatch.setattr(scripts.reload, "install", install)
        said: list[str] = []
        result = reload(new, timeout_s=5, say=said.append, settings=settings)
        os.kill(server.proc.pid, signal.SIGCONT)
        assert result.status == REFUSED, (result, said)
        assert len(said) == 1 and said[0].startswith("reload refused, nothing changed: Redis "
                                                     "did not answer"), said
        assert target.read_bytes() == old
        assert client.get(MODELS_REVISION_KEY) == revision_of(old)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


def test_a_reload_with_no_worker_to_ask_waits_for_one_then_is_refused_and_nothing_changes(
        tmp_path, client, redis_server):
    """No worker reports (none runs, or none consumes yet): its checks once passed for want
    of a worker to ask and the file was installed and announced. Now it waits for one up to
    its timeout, saying so at once, then refuses, nothing changed; a worker that reports
    within it (one starting) lets it go on."""
    target = tmp_path / "models.yaml"
    target.write_text(yaml.safe_dump({"models": MODELS}))
    settings = load_settings({"redis_url": redis_server.extra["url"],
                              "models_file": str(target)}, environ={})
    before = target.read_bytes()
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump({"models": {**MODELS, "other": MODELS["quick"]}}))
    said: list[str] = []
    started = time.monotonic()
    result = reload(new, timeout_s=2, say=said.append, settings=settings)
    assert result.status == INVALID and time.monotonic() - started >= 2, said
    assert said == [
        "no worker reports on REDIS_URL's Redis (none runs, or none consumes yet): waiting up "
        "to 2s for one",
        "reload refused, nothing changed: no worker reports on REDIS_URL's Redis after 2s: a "
        "reload is checked against the workers that would serve its models, and taken up by "
        "them first; start one (make run) and reload again"], said
    assert target.read_bytes() == before and not (tmp_path / "models.yaml.previous").exists()
    assert client.get(MODELS_REVISION_KEY) is None  # nothing announced

    # A worker that starts while it waits: the reload goes on, and is done once it serves.
    waiting, stop = threading.Event(), threading.Event()

    def worker() -> None:
        waiting.wait(30)
        while not stop.is_set():
            report(client, client.get(MODELS_REVISION_KEY) or "old", "serving",
                   queues=["quick", "other"])
            stop.wait(0.1)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    said.clear()
    try:
        result = reload(new, timeout_s=30, say=lambda line: (
            said.append(line), "waiting up to" in line and waiting.set()), settings=settings)
    finally:
        stop.set()
        thread.join(10)
    assert result.status == DONE and said[0].startswith("no worker reports"), said
    assert target.read_bytes() == new.read_bytes()


def reload_beside(worker, stop: threading.Event, settings) -> tuple:
    """`make reload` (30 s) with `worker` acting in a thread until it is done: (its result,
    what it said)."""
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    said: list[str] = []
    try:
        return reload(timeout_s=30, say=said.append, settings=settings), said
    finally:
        stop.set()
        thread.join(10)


def test_a_worker_that_stopped_is_awaited_back_under_a_new_name(tmp_path, client, redis_server):
    """A worker that stopped consuming during the reload (killed) is awaited a while
    (scripts/reload_wait.py `Restarts`): one started again by its keeper on its host and
    queues under a new name (make run's are named by their pid) takes its place, and the
    reload is done once it serves the revision; with none back within three heartbeat TTLs,
    the stopped worker is gone and the reload refused, as before."""
    setup(tmp_path, client, redis_server)
    settings = load_settings({"redis_url": redis_server.extra["url"],
                              "models_file": str(tmp_path / "models.yaml"),
                              "heartbeat_interval_s": 0.5, "heartbeat_ttl_s": 1.0}, environ={})
    for restarted, expected in ((True, DONE), (False, REFUSED)):
        client.delete(MODELS_REVISION_KEY, RELOAD_STATUS_KEY)
        client.zrem(CONSUMING_KEY, "w2@h")
        report(client, "old", "serving", queues=["quick"])
        stop = threading.Event()

        def worker() -> None:
            revision = announced(client)
            client.zrem(CONSUMING_KEY, "w@h")  # killed: its heartbeat stops
            while restarted and not stop.is_set():  # its keeper started it again
                client.zadd(CONSUMING_KEY, {"w2@h": time.time()})
                client.hset(RELOAD_STATUS_KEY, "worker:w2@h", orjson.dumps(
                    {"revision": revision, "state": "serving", "at": time.time(),
                     "children_left": 0, "error": "", "refused": "", "queues": ["quick"]}))
                stop.wait(0.2)

        result, said = reload_beside(worker, stop, settings)
        assert result.status == expected, said
        if restarted:
            assert "  worker:w@h: restarted as worker:w2@h" in said, said
        else:
            assert any(line.startswith("  worker:w@h: pending: stopped consuming during the "
                                       "reload; awaited back") for line in said), said
            assert "  worker:w@h: gone: stopped consuming during the reload (see its log)" \
                in said, said


def test_a_worker_restarted_just_before_the_reload_takes_the_killed_ones_place(
        tmp_path, client, redis_server):
    """A worker killed moments before a reload, started again by its keeper under a new name:
    when the reload begins both are among the consuming workers (the killed one's heartbeat
    still within its TTL). The new one, started after the killed one last reported, takes its
    place and the reload is done. (Before, a worker there when the reload began was never a
    successor: the killed one was awaited three TTLs, then gone, and the reload refused and
    undone.) A worker beside it all along, or one on other queues, takes no one's place."""
    setup(tmp_path, client, redis_server)
    settings = load_settings({"redis_url": redis_server.extra["url"],
                              "models_file": str(tmp_path / "models.yaml"),
                              "heartbeat_interval_s": 0.5, "heartbeat_ttl_s": 2.0}, environ={})
    cases = (("restarted", ["quick"], DONE), ("beside", ["quick"], REFUSED),
             ("restarted", ["other"], REFUSED))
    for when, queues, expected in cases:
        client.delete(MODELS_REVISION_KEY, RELOAD_STATUS_KEY, CONSUMING_KEY)
        # The killed worker's last report, its heartbeat within its TTL; it never beats again.
        report(client, "old", "serving", queues=["quick"], started=time.time() - 60)
        last = orjson.loads(client.hget(RELOAD_STATUS_KEY, "worker:w@h"))["at"]
        started = last + 0.01 if when == "restarted" else last - 30
        stop = threading.Event()

        def beat(revision: str, started: float = started, queues: list = queues) -> None:
            client.zadd(CONSUMING_KEY, {"w2@h": time.time()})
            client.hset(RELOAD_STATUS_KEY, "worker:w2@h", orjson.dumps(
                {"revision": revision, "state": "serving", "at": time.time(), "started": started,
                 "children_left": 0, "error": "", "refused": "", "queues": queues}))

        def worker() -> None:
            revision = announced(client)
            while not stop.is_set():  # the new one serves what it read as it started
                beat(revision)
                stop.wait(0.2)

        beat("old")  # consuming before the reload begins
        result, said = reload_beside(worker, stop, settings)
        assert result.status == expected, (when, queues, said)
        assert ("  worker:w@h: restarted as worker:w2@h" in said) == (expected == DONE), said
