"""A reload that moves a model to another Redis group (`redis:`) while jobs of it wait on its
queue on the old group's Redis is refused, naming the field and how many wait, and nothing
changes (scripts/models_check.py `stranded`): once no worker there consumes the queue they
would wait for ever, and a renamed queue as well would have had a worker on the old Redis
move them onto a queue there that no worker reads. Two real redis-servers (the default and
group b) and the API's own submit put the jobs on the queue; no worker runs, so they wait
(a worker on each Redis is its report only, following what is announced there, as make
reload needs one on each Redis the file's models are on)."""
from __future__ import annotations

import threading

import pytest
import redis
import yaml

from app import create_app
from config import load_settings
from scripts.reload import DONE, INVALID, reload
from scripts.stack import start_redis, wait_until
from tasks.keys import MODELS_REVISION_KEY, RELOAD_STATUS_KEY
from tests.integration.test_reload_timeout import report

MODEL = {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}


@pytest.fixture
def groups(tmp_path):
    servers = {name: start_redis(tmp_path) for name in ("default", "b")}
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": {"m": MODEL}}))
    settings = {"redis_url": servers["default"].extra["url"], "models_file": str(models),
                "redis_groups": f"b={servers['b'].extra['url']}"}
    app = create_app(settings)
    stop = threading.Event()

    def worker(client: redis.Redis) -> None:
        """A worker that consumes every queue and serves what is announced (its report)."""
        while not stop.is_set():
            report(client, client.get(MODELS_REVISION_KEY) or "", "serving", queues=[],
                   consumes_all=True)
            stop.wait(0.1)

    workers = [threading.Thread(target=worker, daemon=True, args=(
        redis.Redis.from_url(server.extra["url"], decode_responses=True),))
        for server in servers.values()]
    for thread in workers:
        thread.start()
    try:
        wait_until(lambda: all(redis.Redis.from_url(server.extra["url"]).hlen(RELOAD_STATUS_KEY)
                               for server in servers.values()), 30, "the workers' reports")
        yield app.test_client(), load_settings(settings, environ={}), servers
    finally:
        stop.set()
        for thread in workers:
            thread.join(10)
        app.extensions["iq.store"].close()
        for server in servers.values():
            server.stop()


@pytest.mark.parametrize("change, named", [
    ({"redis": "b"}, "models.m.redis: REDIS_URL -> b while 3 job(s) wait on queue m on "
                     "REDIS_URL's Redis: drain it first"),
    ({"redis": "b", "queue": "m2"}, "models.m.redis: REDIS_URL -> b and queue m -> m2 while 3 "
                                    "job(s) wait on queue m on REDIS_URL's Redis: drain it "
                                    "first"),
])
def test_moving_a_model_to_another_group_with_jobs_waiting_is_refused(groups, tmp_path, change,
                                                                       named):
    api, settings, servers = groups
    for _ in range(3):
        assert api.post("/v1/jobs", json={"model": "m", "inputs": ["x"]}).status_code == 202
    target = tmp_path / "models.yaml"
    before = target.read_bytes()
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump({"models": {"m": {**MODEL, **change}}}))
    said: list[str] = []
    result = reload(new, timeout_s=5, say=said.append, settings=settings)
    assert result.status == INVALID and said == [f"reload refused, nothing changed: {named} "
                                                  "(stop submitting, wait for iq_queue_depth 0)"]
    assert target.read_bytes() == before
    for server in servers.values():
        assert redis.Redis.from_url(server.extra["url"]).get(MODELS_REVISION_KEY) is None


def test_moving_a_model_with_no_job_waiting_is_done(groups, tmp_path):
    api, settings, _ = groups
    new = tmp_path / "new.yaml"
    new.write_bytes(yaml.safe_dump({"models": {"m": {**MODEL, "redis": "b"}}}).encode())
    result = reload(new, timeout_s=5, say=lambda line: None, settings=settings)
    assert result.status == DONE, result
    assert (tmp_path / "models.yaml").read_bytes() == new.read_bytes()


def test_a_retry_of_a_job_whose_model_has_moved_group_since_is_refused(groups, tmp_path):
    """A retry is linked to its job in one script on one Redis: a job that ran on REDIS_URL's
    Redis cannot be retried once its model is on group b's (409, naming the group), and the job
    is left unlinked."""
    api, _, servers = groups
    job = api.post("/v1/jobs", json={"model": "m", "inputs": ["x"]}).get_json()
    assert api.post(f"/v1/jobs/{job['id']}/cancel").get_json()["status"] == "cancelled"
    (tmp_path / "models.yaml").write_text(
        yaml.safe_dump({"models": {"m": {**MODEL, "redis": "b"}}}))
    moved = create_app({"redis_url": servers["default"].extra["url"],
                        "models_file": str(tmp_path / "models.yaml"),
                        "redis_groups": f"b={servers['b'].extra['url']}"})
    try:
        client = moved.test_client()
        assert client.get(f"/v1/jobs/{job['id']}").get_json()["status"] == "cancelled"
        refused = client.post(f"/v1/jobs/{job['id']}/retry")
        assert refused.status_code == 409, refused.get_data(as_text=True)
        assert "moved to Redis group 'b'" in refused.get_json()["error"]["message"]
        assert client.get(f"/v1/jobs/{job['id']}").get_json().get("retried_as") is None
    finally:
        moved.extensions["iq.store"].close()
