"""Reloads the running processes cannot serve, on the default settings, under load (a few jobs/s,
each job's runs counted), against one worker and one API process configured with a second
Redis group (`spare`):

- a file moving the model to a group only the operator's shell has (IQ_REDIS_GROUPS exported
  there, not where the processes run): refused with one line naming the field, nothing
  changed (the file on disk, the announced revision). Once, it was installed, gunicorn's
  master exited 24 times and the pool children started 641 times in 10 min;
- a file naming a model file that is not there: refused the same way;
- a file adding a model on `spare` while spare's Redis is down (configured, so the check
  passes): announced on spare's Redis first, which does not answer, `make reload` exits 2
  well within its deadline, the previous file back in place, no process told of the new one
  (it used to reach the API, whose canary could not reach spare: its gunicorn was never
  asked to reload, and the worker rolled back);
- that file announced without make reload's check: each process refuses it itself and keeps
  serving, no pool child or gunicorn master started on it.

Every accepted job succeeds, once."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import orjson
import pytest
import requests
import yaml

from config.models import revision_of
from scripts.stack import ROOT, launch, start_redis, start_worker, wait_until
from tasks.keys import MODELS_ANNOUNCEMENTS_KEY, MODELS_REVISION_KEY, RELOAD_STATUS_KEY
from tests.faults.test_reload_unloadable import check_every_job, instances
from tests.support.load import Load

pytestmark = pytest.mark.slow

TIMEOUT_S = 120


def reload(stack, models: dict, **env: str) -> subprocess.CompletedProcess:
    """`make reload FILE=…` from a shell with the stack's environment and `env`."""
    new = stack.workdir / "new.yaml"
    new.write_text(yaml.safe_dump({"models": models}))
    return subprocess.run([sys.executable, "-m", "scripts.reload", str(new),
                           "--timeout", str(TIMEOUT_S)], cwd=ROOT, env={**stack.env, **env},
                          capture_output=True, text=True, timeout=TIMEOUT_S * 3)


def api_processes(stack) -> dict[str, dict]:
    return {name: orjson.loads(raw) for name, raw in stack.redis.hgetall(RELOAD_STATUS_KEY).items()
            if name.startswith("api:")}


def reports(stack) -> dict[str, dict]:
    return {name: orjson.loads(raw) for name, raw in stack.redis.hgetall(RELOAD_STATUS_KEY).items()}


def announce(stack, revision: str) -> None:
    """As make reload announces a revision (scripts/reload.py), without its check."""
    with stack.redis.pipeline() as pipe:
        pipe.incr(MODELS_ANNOUNCEMENTS_KEY)
        pipe.set(MODELS_REVISION_KEY, revision)
        pipe.execute()


def served_revision(stack) -> str:
    return requests.get(f"{stack.api}/v1/models", timeout=10).json()["revision"]


def test_a_reload_the_running_processes_cannot_serve_changes_nothing_and_loses_nothing(
        tmp_path):
    quick = {"kind": "synthetic", "base_ms": 20, "per_item_ms": 0, "max_batch_size": 4,
             "runs_log": str(tmp_path / "runs.log")}
    (tmp_path / "spare").mkdir()
    spare = start_redis(tmp_path / "spare")
    groups = f"spare={spare.extra['url']}"
    stack = launch(tmp_path, {"quick": quick}, {}, {"IQ_REDIS_GROUPS": groups},
                   defaults=True, ready_models=[])
    models_file = tmp_path / "models.yaml"
    old_bytes = models_file.read_bytes()
    old = revision_of(old_bytes)
    load = None
    try:
        stack.workers["w"] = start_worker("w", stack.env, tmp_path, None)
        wait_until(lambda: instances(stack) == 1, 180, "the worker's child loaded")
        # Both report what they can serve (a process that has not yet is not checked by
        # make reload; it refuses the file itself: the last case below).
        wait_until(lambda: {n.split(":")[0] for n, s in reports(stack).items()
                            if s.get("groups") == ["spare"]} == {"api", "worker"}, 60,
                   "the API's and the worker's reports")
        # Each API process says which gunicorn it belongs to (its address: gunicorn.conf.py),
        # for a reload to count them.
        assert {s["service"].split(" ", 1)[1] for s in api_processes(stack).values()} == \
            {stack.api.split("//", 1)[1]}
        load = Load(stack.api, "quick", "load", clients=2, pause_s=0.2).start()
        wait_until(lambda: len(load.accepted) > 10, 60, "the load to run")
        announced = stack.redis.get(MODELS_REVISION_KEY)

        # A group the operator's shell has and the processes lack.
        elsewhere = spare.extra["url"].rsplit("/", 1)[0] + "/2"
        moved = reload(stack, {"quick": {**quick, "redis": "gpu"}},
                       IQ_REDIS_GROUPS=f"{groups},gpu={elsewhere}")
        assert moved.returncode == 1, moved.stdout + moved.stderr
        line = next(x for x in moved.stdout.splitlines() if "models.quick.redis" in x)
        assert line.startswith("reload refused, nothing changed: models.quick.redis: group "
                               "'gpu' is not configured in the running API/worker processes "
                               "(api:"), moved.stdout
        assert "worker:w@" in line
        # A model file that is not there.
        missing = reload(stack, {"quick": quick, "ts": {
            "kind": "torchscript", "path": str(tmp_path / "nowhere.pt"), "input_shape": [1]}})
        assert missing.returncode == 1 and "nowhere.pt does not exist" in missing.stdout
        assert models_file.read_bytes() == old_bytes
        assert not (tmp_path / "models.yaml.previous").exists()
        assert stack.redis.get(MODELS_REVISION_KEY) == announced
        assert served_revision(stack) == old

        # A group whose Redis is down: announced there first, it does not answer; nothing
        # reaches any process (the API's canary, which cannot reach it either, is the second
        # line: tests/integration/test_models_watch.py).
        before = set(api_processes(stack))
        seen: set[str] = set()
        watching = threading.Event()

        def sample() -> None:
            while not watching.is_set():
                seen.add(served_revision(stack))
                watching.wait(0.3)

        sampler = threading.Thread(target=sample, daemon=True)
        spare.stop()
        sampler.start()
        started = time.monotonic()
        down = reload(stack, {"quick": {**quick, "version": "2"},
                              "other": {"kind": "synthetic", "redis": "spare"}})
        took = time.monotonic() - started
        watching.set()
        sampler.join(10)
        bad = revision_of((tmp_path / "new.yaml").read_bytes())
        assert down.returncode == 2, down.stdout + down.stderr
        assert down.stdout.splitlines()[-1].startswith(
            "reload refused, nothing changed: Redis group spare did not answer"), down.stdout
        assert down.stdout.splitlines()[-1].endswith(f"is revision {old} as before"), \
            down.stdout
        assert f"revision {bad} announced" not in down.stdout, down.stdout
        assert took < TIMEOUT_S
        # The API never took it: the same process served the old file throughout.
        assert seen == {old}
        assert set(api_processes(stack)) == before
        assert models_file.read_bytes() == old_bytes
        assert served_revision(stack) == old
        wait_until(lambda: instances(stack) == 1, 60, "the worker's child live")

        # Announced without make reload's check (a process that had not reported yet): each
        # process checks it against its own settings, refuses it and keeps serving; neither
        # a pool child nor the master is started on it.
        log = stack.workers["w"].log
        logged = len(log.read_text(errors="replace"))
        unservable = yaml.safe_dump({"models": {"quick": {**quick, "redis": "gpu"}}}).encode()
        models_file.write_bytes(unservable)
        announce(stack, revision_of(unservable))
        wait_until(lambda: {s["state"] for s in reports(stack).values()} == {"refused"}, 120,
                   "every process to refuse it")
        errors = {n.split(":")[0]: s["error"] for n, s in reports(stack).items()}
        wrong = "models.quick: redis must name a group of redis_groups (spare), got 'gpu'"
        assert wrong in errors["worker"] and f"(its canary: {wrong})" in \
            errors["api"], errors
        assert set(api_processes(stack)) == before and served_revision(stack) == old
        assert instances(stack) == 1
        assert "exited with" not in log.read_text(errors="replace")[logged:]  # no child
        models_file.write_bytes(old_bytes)
        announce(stack, old)
        wait_until(lambda: {(s["revision"], s["state"]) for s in reports(stack).values()} ==
                   {(old, "serving")}, 60, "every process back to serving")
        load.stop()
        check_every_job(stack, load)
        print(f"\nunservable reloads under load: {len(load.accepted)} jobs, each ran once; the "
              f"reload whose canary failed took {took:.1f}s")
    finally:
        if load is not None:
            load.stop()
        stack.stop()
        spare.stop()
