"""Redis groups behind one API (app/group_stores.py) with some of them frozen: what reads every
group (/metrics, /readyz, /v1/models, GET /v1/jobs) asks them all at once under the request's
one deadline (tasks/redis_deadline.py), so that it costs one deadline however many groups do
not answer and however many reads it makes, answers with what the others hold, and the default
group's jobs are not held."""
from __future__ import annotations

import os
import signal
import time

import pytest
import yaml

from app import create_app
from scripts.stack import start_redis

DEADLINE_S = 1.0
SLACK_S = 0.25  # the answer's own work past the deadline (README: Reliability)
MODELS = {"on-default": {"kind": "synthetic"}, "on-b": {"kind": "synthetic", "redis": "b"},
          "on-c": {"kind": "synthetic", "redis": "c"}, "on-d": {"kind": "synthetic", "redis": "d"}}


@pytest.fixture
def frozen(tmp_path):
    servers = {name: start_redis(tmp_path) for name in ("default", "b", "c", "d")}
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": MODELS}))
    app = create_app({"redis_url": servers["default"].extra["url"],
                      "redis_groups": ",".join(f"{name}={servers[name].extra['url']}"
                                               for name in ("b", "c", "d")),
                      "models_file": str(models), "redis_deadline_s": DEADLINE_S})
    client = app.test_client()
    assert client.post("/v1/jobs", json={"model": "on-b", "inputs": ["x"]}).status_code == 202
    for name in ("b", "c", "d"):
        os.kill(servers[name].proc.pid, signal.SIGSTOP)
    try:
        yield client
    finally:
        for name in ("b", "c", "d"):
            os.kill(servers[name].proc.pid, signal.SIGCONT)
        app.extensions["iq.store"].close()
        for server in servers.values():
            server.send()


def timed(call):
    started = time.monotonic()
    answer = call()
    return time.monotonic() - started, answer


def test_three_frozen_groups_cost_one_deadline_for_the_whole_request(frozen):
    took, answer = timed(lambda: frozen.get("/metrics"))
    # Two reads of every group (queue depths, kept requests): one deadline for both.
    assert answer.status_code == 200 and took < DEADLINE_S + SLACK_S, took
    assert 'iq_queue_depth{model="on-default"} 0.0' in answer.get_data(as_text=True)
    for path, status in (("/readyz", 503), ("/v1/models", 200), ("/v1/jobs", 200)):
        took, answer = timed(lambda: frozen.get(path))
        assert answer.status_code == status and took < DEADLINE_S + SLACK_S, (path, took)
    # The listing holds the default group's jobs and names the groups it could not read.
    listed = frozen.get("/v1/jobs").get_json()
    assert listed["unreachable"] == ["redis:b", "redis:c", "redis:d"], listed
    assert {job["model"] for job in listed["jobs"]} <= {"on-default"}
    # As the OpenAPI document says a page is.
    documented = frozen.get("/openapi.json").get_json()["components"]["schemas"]["JobList"]
    assert set(listed) <= set(documented["properties"])
    assert documented["properties"]["unreachable"]["items"] == {"type": "string"}
    # /v1/models still shows every model: the frozen groups' with their counts unknown.
    shown = {m["name"]: m for m in frozen.get("/v1/models").get_json()["models"]}
    assert shown["on-default"]["instances"] == 0 and "unreachable" not in shown["on-default"]
    frozen_models = {name: m for name, m in shown.items() if name != "on-default"}
    assert frozen_models and all(m["instances"] is None and m["unreachable"].startswith("redis:")
                                 for m in frozen_models.values())
    checks = frozen.get("/readyz").get_json()["checks"]
    assert checks["redis"]["ok"] and not checks["redis:b"]["ok"] and not checks["redis:d"]["ok"]
    took, answer = timed(lambda: frozen.post("/v1/jobs", json={"model": "on-default",
                                                               "inputs": ["x"]}))
    assert answer.status_code == 202 and took < 0.5, took
