"""Redis groups behind one API (config/groups.py, app/group_stores.py): two private redis-servers,
the default (REDIS_URL) and group `b` (IQ_REDIS_GROUPS), one prefork `celery worker` per
group started with its group's REDIS_URL and queues, one gunicorn API. Each job's record,
result and queue are on its model's Redis and nowhere else; reads, waits, event streams,
cancel, retry, listing, /metrics, /readyz and a models reload work across both; with group
b's Redis down its models and jobs answer 503 naming it, the listing names it, and the default
group's jobs still succeed."""
from __future__ import annotations

import os
import time
import uuid

import orjson
import pytest
import redis
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from app.events import HEARTBEAT_S
from config import load_settings
from config.job_ids import group_tag
from scripts.stack import Stack, start_redis, start_web, start_worker, wait_until
from scripts.reload import DONE, reload
from tasks.keys import RELOAD_STATUS_KEY, job_key, result_key
from tasks.names import queue_lists
from tests.support.sse import events_of

QUICK = {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0, "max_batch_size": 8}
MODELS = {
    "quick-a": QUICK,
    "quick-b": {**QUICK, "redis": "b"},
    # On group b, consumed by no worker: its jobs stay queued.
    "parked-b": {"kind": "synthetic", "redis": "b"},
}


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("groups")
    models_file = workdir / "models.yaml"
    models_file.write_text(yaml.safe_dump({"models": MODELS}))
    redis_a, redis_b = start_redis(workdir), start_redis(workdir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("IQ_")}
    env.update(REDIS_URL=redis_a.extra["url"], IQ_REDIS_GROUPS=f"b={redis_b.extra['url']}",
               IQ_MODELS_FILE=str(models_file), PYTHONUNBUFFERED="1",
               IQ_HEARTBEAT_INTERVAL_S="0.5", IQ_HEARTBEAT_TTL_S="3")
    workers = {"a": start_worker("a", env, workdir, ["quick-a"]),
               # A group's worker: the group's Redis as REDIS_URL, the group's queues.
               "b": start_worker("b", dict(env, REDIS_URL=redis_b.extra["url"]), workdir,
                                 ["quick-b"])}
    web = start_web(env, workdir)
    stack = Stack(web.extra["url"], redis_a.extra["url"], env, workdir, redis_a, workers, web)
    stack.redis_b = redis_b
    try:
        stack.wait_live(["quick-a", "quick-b"], 180)
        yield stack
    except BaseException:
        print(stack.logs(), redis_b.tail())
        raise
    finally:
        stack.stop()
        stack.redis_b.stop()


def clients(stack) -> dict[str, redis.Redis]:
    return {"a": stack.redis, "b": redis.Redis.from_url(stack.redis_b.extra["url"],
                                                        decode_responses=True)}


def depths(stack) -> dict[str, float]:
    """iq_queue_depth per model, as /metrics answers it."""
    text = requests.get(f"{stack.api}/metrics", timeout=10).text
    return {sample.labels["model"]: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "iq_queue_depth" for sample in family.samples}


def keys_naming(client: redis.Redis, job_id: str) -> set[str]:
    return set(client.scan_iter(match=f"*{job_id}*", count=1000))


def submit(stack, model: str, wait: float | None = None) -> requests.Response:
    headers = {"Prefer": f"wait={wait:g}"} if wait else {}
    return requests.post(f"{stack.api}/v1/jobs", json={"model": model, "inputs": ["x"]},
                         headers=headers, timeout=60)


def test_each_job_and_its_queue_live_on_its_models_redis_only(groups):
    redis_of = clients(groups)
    on_a = submit(groups, "quick-a", wait=30)
    on_b = submit(groups, "quick-b", wait=30)
    assert on_a.status_code == on_b.status_code == 201, (on_a.text, on_b.text)
    a_id, b_id = on_a.json()["id"], on_b.json()["id"]
    # The default group's ids are as they always were; group b's carry its tag.
    assert uuid.UUID(a_id).version == 4
    assert uuid.UUID(b_id).version == 8 and b_id.startswith(group_tag("b"))
    for job_id, home, other in ((a_id, "a", "b"), (b_id, "b", "a")):
        assert {job_key(job_id), result_key(job_id)} <= keys_naming(redis_of[home], job_id)
        assert keys_naming(redis_of[other], job_id) == set(), (job_id, other)
        read = groups.job(job_id)
        assert read["status"] == "succeeded" and read["result"], read
    # Queued on group b with no worker: its message waits on b's queue lists alone, and
    # /metrics reads that depth from b.
    parked = groups.submit("parked-b", ["x"])
    assert sum(redis_of["b"].llen(name) for name in queue_lists("parked-b")) == 1
    assert not any(redis_of["a"].exists(name) for name in queue_lists("parked-b"))
    assert keys_naming(redis_of["a"], parked["id"]) == set()
    assert depths(groups)["parked-b"] == 1
    # A wait on a job of group b is woken by group b's listener.
    queued = groups.submit("quick-b", ["y"])
    assert groups.job(queued["id"], wait=30)["status"] == "succeeded"


def test_cancel_retry_and_events_reach_the_jobs_redis(groups):
    redis_of = clients(groups)
    parked = groups.submit("parked-b", ["x"])["id"]
    with requests.get(f"{groups.api}/v1/jobs/{parked}/events", stream=True,
                      timeout=60) as stream:
        lines = stream.iter_lines(decode_unicode=True)
        seen: list[str] = []
        for line in lines:  # up to the end of its first event
            seen.append(line)
            if line == "" and any(x.startswith("event:") for x in seen):
                break
        r = requests.post(f"{groups.api}/v1/jobs/{parked}/cancel", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        cancelled_at = time.monotonic()
        seen += list(lines)  # the stream ends after the job's final event
    # Woken by group b's listener, not by the stream's next heartbeat.
    assert time.monotonic() - cancelled_at < HEARTBEAT_S
    assert [name for name, _, _ in events_of(seen)] == ["queued", "cancelled"]
    assert redis_of["b"].hget(job_key(parked), "status") == "cancelled"
    r = requests.post(f"{groups.api}/v1/jobs/{parked}/retry", timeout=10)
    assert r.status_code == 202, r.text
    again = r.json()["id"]
    assert again.startswith(group_tag("b")) and r.json()["retry_of"] == parked
    assert redis_of["b"].hget(job_key(again), "status") == "queued"
    assert keys_naming(redis_of["a"], again) == set()


def test_the_callers_jobs_are_listed_from_both_groups_newest_first(groups):
    made = [groups.submit(model, ["z"])["id"] for model in ("quick-a", "quick-b") * 2]
    first = requests.get(f"{groups.api}/v1/jobs", params={"limit": 3}, timeout=10).json()
    assert [job["id"] for job in first["jobs"]] == made[::-1][:3]
    second = requests.get(f"{groups.api}{first['next']}", timeout=10).json()
    assert second["jobs"][0]["id"] == made[0]
    # Both groups' earlier jobs follow, none twice.
    listed = requests.get(f"{groups.api}/v1/jobs", params={"limit": 100}, timeout=10).json()
    ids = [job["id"] for job in listed["jobs"]]
    assert len(ids) == len(set(ids)) and set(made) <= set(ids)
    assert {job["model"] for job in listed["jobs"]} == set(MODELS)


def test_a_reload_reaches_the_workers_of_every_group(groups):
    changed = yaml.safe_load((groups.workdir / "models.yaml").read_text())
    changed["models"]["quick-b"]["max_batch_size"] = 4
    source = groups.workdir / "next.yaml"
    source.write_text(yaml.safe_dump(changed))
    said: list[str] = []
    result = reload(source, timeout_s=150, say=said.append,
                    settings=load_settings(environ=groups.env))
    assert result.status == DONE, said
    assert "Redis group b:" in said, said
    on_b = {name: orjson.loads(raw) for name, raw in
            clients(groups)["b"].hgetall(RELOAD_STATUS_KEY).items()}
    assert [report["revision"] for name, report in on_b.items()
            if name.startswith("worker:b@")] == [result.revision], on_b
    assert submit(groups, "quick-b", wait=30).status_code == 201


def test_a_reload_moving_a_model_where_no_worker_consumes_it_is_refused(groups):
    """By the workers' reports on the group's own Redis: quick-a moved to group b, whose only
    worker consumes quick-b's queue, would wait there for ever; the reload is refused in one
    line naming the field, nothing changed (it was once "done", its jobs never ran)."""
    target = groups.workdir / "models.yaml"
    before = target.read_bytes()
    changed = yaml.safe_load(before)
    changed["models"]["quick-a"]["redis"] = "b"
    source = groups.workdir / "moved.yaml"
    source.write_text(yaml.safe_dump(changed))
    said: list[str] = []
    result = reload(source, timeout_s=60, say=said.append,
                    settings=load_settings(environ=groups.env))
    assert result.status == 1, said
    assert said == ["reload refused, nothing changed: models.quick-a.queue: no worker on group "
                    "'b' consumes queue 'quick-a': its jobs would wait there for ever; start "
                    "one that does (its -Q) before a reload names it"], said
    assert target.read_bytes() == before
    assert submit(groups, "quick-a", wait=30).status_code == 201


def test_a_group_whose_redis_is_down_answers_503_and_the_other_keeps_working(groups):
    done = groups.submit("quick-b", ["before"])["id"]
    groups.finished(done)
    groups.redis_b.stop()

    r = requests.get(f"{groups.api}/readyz", timeout=10)
    checks = r.json()["checks"]
    assert r.status_code == 503 and checks["redis:b"] == {"ok": False, "error": "unreachable"}
    assert checks["redis"]["ok"] and checks["model:quick-a"]["ok"]
    assert not checks["model:quick-b"]["ok"]

    refused = submit(groups, "quick-b")
    assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
    assert "Redis group 'b'" in refused.json()["error"]["message"]
    # Every call on one of its jobs is a 503 naming the group: a read, a wait, a cancel, a
    # retry, a delete, its events.
    for method, path in (("GET", ""), ("GET", "?wait=5"), ("POST", "/cancel"),
                         ("POST", "/retry"), ("DELETE", ""), ("GET", "/events")):
        r = requests.request(method, f"{groups.api}/v1/jobs/{done}{path}", timeout=10)
        assert r.status_code == 503 and r.headers["Retry-After"], (method, path, r.text)
        assert "Redis group 'b'" in r.json()["error"]["message"], (method, path, r.text)
    # The listing holds the default group's jobs and names the one it could not read.
    listing = requests.get(f"{groups.api}/v1/jobs", timeout=10)
    assert listing.status_code == 200 and listing.json()["unreachable"] == ["redis:b"]
    assert {job["model"] for job in listing.json()["jobs"]} <= {"quick-a"}, listing.text

    accepted = submit(groups, "quick-a", wait=30)
    assert accepted.status_code == 201 and accepted.json()["status"] == "succeeded"
    assert groups.job(accepted.json()["id"])["status"] == "succeeded"
    only_a = requests.get(f"{groups.api}/v1/jobs", params={"model": "quick-a"}, timeout=10)
    assert only_a.status_code == 200 and only_a.json()["jobs"][0]["id"] == accepted.json()["id"]
    # Each model's depth from its own Redis: group b's are left out, not reported as 0.
    assert "quick-a" in depths(groups) and "quick-b" not in depths(groups)

    # Back (empty: it kept nothing on disk), group b takes jobs again.
    groups.redis_b = start_redis(groups.workdir, like=groups.redis_b)
    wait_until(lambda: submit(groups, "quick-b").status_code == 202, 60, "group b back")
