"""The API takes a reloaded models file only once the workers serve it (app/reloading.py), on
the default settings, one worker with one child, under load, runs counted per job. A reload
adding a model whose pool child cannot load it (an archive that is no TorchScript program,
which make reload's check lets through): no job of it is ever accepted (422 throughout, where
the API once served it for ~9 s and its 12 jobs then failed `model_removed`), no other job
fails. A reload removing a model and adding that bad one: the removed model's jobs keep being
accepted and succeed, each once (they once got 422 for ~8 s, and 15 accepted ones failed
`model_removed`): the worker holds a model the reload in progress removes until every child is
on the new file, and its rollback serves it again."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import redis
import requests
import yaml

from scripts.stack import ROOT, launch, start_redis, start_worker, wait_until
from tests.support.load import Load, runs
from tests.support.models import build_hollow_archive
from tests.support.records import fields_of

pytestmark = pytest.mark.slow


def reload(stack, models: dict) -> subprocess.CompletedProcess:
    new = stack.workdir / "new.yaml"
    new.write_text(yaml.safe_dump({"models": models}))
    return subprocess.run([sys.executable, "-m", "scripts.reload", str(new), "--timeout", "120"],
                          cwd=ROOT, env=stack.env, capture_output=True, text=True, timeout=300)


def synthetic(tmp_path, name: str) -> dict:
    return {"kind": "synthetic", "base_ms": 20, "per_item_ms": 0, "max_batch_size": 4,
            "runs_log": str(tmp_path / f"{name}.log")}


class Submits:
    """Submits of the new model's jobs, as fast as answered, each answer's status kept."""

    def __init__(self, api: str) -> None:
        self.api, self.statuses, self.stop = api, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            answer = requests.post(f"{self.api}/v1/jobs", timeout=30,
                                   json={"model": "ts", "inputs": [[1.0]]})
            self.statuses.append((answer.status_code, answer.text))
            self.stop.wait(0.1)

    def end(self) -> list:
        self.stop.set()
        self.thread.join(60)
        return self.statuses


def check_every_job(stack, load: Load, log, client=None) -> None:
    """Every accepted job of `load` succeeded, each ran once; its records on `client`'s Redis
    (default: REDIS_URL's)."""
    assert load.gave_up == [] and len(load.accepted) > 10, (load.gave_up, load.statuses())
    for job_id in load.accepted.values():
        stack.finished(job_id, timeout=120)
    records = fields_of(client or stack.redis, list(load.accepted.values()))
    assert {r["status"] for r in records.values()} == {"succeeded"}, \
        {j: (r["status"], r.get("error")) for j, r in records.items() if r["status"] != "succeeded"}
    ran = runs(log)
    assert {text: ran[text] for text in load.accepted} == {text: 1 for text in load.accepted}


def test_the_api_never_serves_a_model_before_the_workers_do(tmp_path):
    quick, other = synthetic(tmp_path, "quick"), synthetic(tmp_path, "other")
    weights = build_hollow_archive(tmp_path / "hollow.pt")
    bad = {"kind": "torchscript", "path": str(weights), "input_shape": [1]}
    stack = launch(tmp_path, {"quick": quick, "other": other}, {"a": None}, defaults=True)
    loads: list[Load] = []
    try:
        # s3: a model added that no child can load.
        loads += [Load(stack.api, "quick", "q1", clients=2, pause_s=0.1).start()]
        submits = Submits(stack.api)
        added = reload(stack, {"quick": quick, "other": other, "ts": bad})
        wait_until(lambda: len(submits.statuses) > 3, 30, "a submit after the undo")
        statuses = submits.end()
        assert added.returncode == 2 and "refused, and undone" in added.stdout, \
            added.stdout + added.stderr
        assert len(statuses) > 10 and {code for code, _ in statuses} == {422}, statuses
        assert all("unknown model" in text for _, text in statuses), statuses[:3]

        # s9: a model removed, with that bad one added: rolled back, `other` served throughout.
        loads += [Load(stack.api, "other", "o", clients=4, pause_s=0.02).start()]
        wait_until(lambda: len(loads[-1].accepted) > 5, 60, "other's jobs accepted")
        removed = reload(stack, {"quick": quick, "ts": bad})
        assert removed.returncode == 2 and "refused, and undone" in removed.stdout, \
            removed.stdout + removed.stderr
        wait_until(lambda: len(loads[-1].accepted) > 40, 120, "more of other's jobs")
        for load in loads:
            load.stop()
        assert 422 not in loads[1].statuses(), loads[1].statuses()
        check_every_job(stack, loads[0], tmp_path / "quick.log")
        check_every_job(stack, loads[1], tmp_path / "other.log")
    except BaseException:
        print(stack.logs())
        raise
    finally:
        for load in loads:
            load.stop()
        stack.stop()


def test_a_model_on_a_group_is_served_only_once_that_groups_workers_serve_it(tmp_path):
    """A Redis group `g` with a worker of its own (its Redis as REDIS_URL), another on
    REDIS_URL's Redis for `quick`: a reload adding a model on g that g's worker cannot load
    is never served by the API (422 throughout), where the API once took the file as soon as
    REDIS_URL's workers served it, and accepted the model's jobs while g's worker failed to
    load it. g's Redis is announced first; the API waits for g's workers too."""
    quick, near = synthetic(tmp_path, "quick"), synthetic(tmp_path, "near")
    near["redis"] = "g"
    bad = {"kind": "torchscript", "path": str(build_hollow_archive(tmp_path / "hollow.pt")),
           "input_shape": [1], "redis": "g"}
    (tmp_path / "g").mkdir()
    group = start_redis(tmp_path / "g")
    stack = launch(tmp_path, {"quick": quick, "near": near}, {"a": ["quick"]},
                   {"IQ_REDIS_GROUPS": f"g={group.extra['url']}"}, defaults=True,
                   ready_models=["quick"])
    on_g = redis.Redis.from_url(group.extra["url"], decode_responses=True)
    loads: list[Load] = []
    try:
        stack.workers["g"] = start_worker("g", dict(stack.env, REDIS_URL=group.extra["url"]),
                                          tmp_path, None)
        stack.wait_live(["quick", "near"], 180)
        loads += [Load(stack.api, "quick", "q", clients=2, pause_s=0.1).start(),
                  Load(stack.api, "near", "n", clients=2, pause_s=0.1).start()]
        wait_until(lambda: all(len(load.accepted) > 5 for load in loads), 60, "the loads")
        submits = Submits(stack.api)
        added = reload(stack, {"quick": quick, "near": near, "ts": bad})
        wait_until(lambda: len(submits.statuses) > 3, 30, "a submit after the undo")
        statuses = submits.end()
        assert added.returncode == 2 and "refused, and undone" in added.stdout, \
            added.stdout + added.stderr
        # g's Redis first: its worker's failed load ended the reload there.
        assert added.stdout.index("Redis group g:") < added.stdout.index(" announced"), \
            added.stdout
        refusal = next(line for line in added.stdout.splitlines()
                       if line.startswith("reload to ") and " refused: " in line)
        assert "g@" in refusal, added.stdout
        assert len(statuses) > 10 and {code for code, _ in statuses} == {422}, statuses
        wait_until(lambda: all(len(load.accepted) > 15 for load in loads), 120, "more jobs")
        for load in loads:
            load.stop()
        check_every_job(stack, loads[0], tmp_path / "quick.log")
        check_every_job(stack, loads[1], tmp_path / "near.log", on_g)
    except BaseException:
        print(stack.logs())
        raise
    finally:
        for load in loads:
            load.stop()
        stack.stop()
        group.stop()
