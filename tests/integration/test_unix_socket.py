"""Redis on the same host over a Unix socket: REDIS_URL=unix:///path/redis.sock?db=N serves
every job end to end (the API's clients, the worker's broker, leases and scripts, the
deliverer, Flower), and every one of the service's connections to Redis is the socket's."""
from __future__ import annotations

import signal
from collections import Counter

import pytest
import redis
import requests
import yaml

from scripts.preflight import REDIS_APP_USER
from scripts.redis_nodes import start_redis_url
from scripts.stack import launch, start_flower, start_webhooks, wait_until
from tests.integration.test_make_run import MakeRun, job_result, run_env
from tests.support.load import runs
from tests.support.receivers import Receiver

AUTH = ("ops", "unix-socket-test-password")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("unix")
    models = {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0,
                        "max_batch_size": 16, "max_wait_ms": 50, "max_inputs": 8,
                        "runs_log": str(workdir / "quick.runs")},
              "sleepy": {"kind": "synthetic", "base_ms": 3000, "per_item_ms": 0,
                         "max_batch_size": 1}}
    stack = launch(workdir, models, {"w": ["quick", "sleepy"]}, unix_socket=True,
                   env_extra={"IQ_WEBHOOK_ALLOW": "127.0.0.1"})
    stack.workers["hooks"] = start_webhooks("hooks", stack.env, workdir, concurrency=2)
    stack.workers["flower"] = start_flower(stack.env, workdir, ":".join(AUTH))
    yield stack
    stack.stop()


def test_the_stack_runs_on_the_socket_url(stack):
    assert stack.env["REDIS_URL"].startswith("unix://")
    assert stack.env["REDIS_URL"].endswith("/redis.sock?db=0")
    checks = requests.get(f"{stack.api}/readyz", timeout=5).json()["checks"]
    assert checks["model:quick"]["instances"] >= 1


def test_every_way_of_serving_a_job_works_over_the_socket(stack):
    api = stack.api
    # Submit and poll.
    polled = stack.submit("quick", ["a"])
    assert stack.finished(polled["id"])["result"] == {"outputs": [1]}
    # Prefer: wait.
    r = requests.post(f"{api}/v1/jobs", json={"model": "quick", "inputs": ["bb", "ccc"]},
                      headers={"Prefer": "wait=20"}, timeout=30)
    assert r.status_code == 201, r.text
    assert r.json()["status"] == "succeeded" and r.json()["result"] == {"outputs": [2, 3]}
    # A batch: several jobs sent together, served by fewer model calls.
    jobs = [stack.submit("quick", ["x" * (i + 1)]) for i in range(6)]
    done = [stack.finished(j["id"]) for j in jobs]
    assert [d["result"] for d in done] == [{"outputs": [i + 1]} for i in range(6)]
    # A cancel: of a job queued behind a running 3 s one.
    running = stack.submit("sleepy", ["s"])
    queued = stack.submit("sleepy", ["t"])
    r = requests.post(f"{api}/v1/jobs/{queued['id']}/cancel", timeout=10)
    assert r.status_code in (200, 202), r.text
    assert stack.finished(queued["id"])["status"] == "cancelled"
    assert stack.finished(running["id"])["status"] == "succeeded"
    # Every input ran once.
    assert runs(stack.workdir / "quick.runs") == \
        Counter(["a", "bb", "ccc", *("x" * (i + 1) for i in range(6))])


def test_a_webhook_is_delivered_over_the_socket(stack):
    receiver = Receiver()
    try:
        r = requests.post(f"{stack.api}/v1/jobs", json={
            "model": "quick", "inputs": ["hello"], "webhook": {"url": receiver.url}}, timeout=10)
        assert r.status_code == 202, r.text
        assert stack.finished(r.json()["id"])["status"] == "succeeded"
        wait_until(lambda: receiver.calls, 30, "the webhook")
    finally:
        receiver.close()


def test_flower_sees_the_worker_over_the_socket(stack):
    flower = stack.workers["flower"].extra["url"]
    wait_until(lambda: any(name.startswith("w@") for name in requests.get(
        f"{flower}/api/workers", auth=AUTH, timeout=5).json()), 30, "Flower to see the worker")
    broker = requests.get(f"{flower}/broker", auth=AUTH, timeout=10)
    assert broker.status_code == 200


def test_every_connection_of_the_service_is_the_socket(stack):
    """Redis's own list of its clients: every one of the application's user (the API, the
    worker and its pool child, the deliverer, Flower) came through the Unix socket."""
    def clients():
        return [c for c in stack.admin.client_list() if c.get("user") == REDIS_APP_USER]

    wait_until(lambda: len(clients()) >= 5, 30, "the service's connections")
    over_tcp = [c for c in clients() if "U" not in c["flags"]]
    assert over_tcp == [], over_tcp


def test_make_run_on_a_redis_socket_is_ready_and_serves_a_job(tmp_path):
    """`make run` given a running Redis's socket in REDIS_URL: its health checks (/readyz,
    each process's) pass, a job is served, and every connection is the socket's."""
    sock = tmp_path / "r.sock"
    foreign, url = start_redis_url(tmp_path, sock)
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": {"synthetic": {
        "kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}}))
    env = run_env(tmp_path, REDIS_URL=url, IQ_MODELS_FILE=str(models))
    run = MakeRun(env, tmp_path / "make-run.log")
    try:
        block = run.wait_up(300)
        assert f"unix://iq:**@{sock}   from REDIS_URL" in block  # kombu's display, no query
        api = f"http://127.0.0.1:{env['IQ_PORT']}"
        assert job_result(api, "synthetic", ["hello"])["result"] == {"outputs": [5]}
        admin = redis.Redis.from_url(foreign.extra["admin_url"], decode_responses=True)
        ours = [c for c in admin.client_list() if c.get("user") == REDIS_APP_USER]
        assert ours and all("U" in c["flags"] for c in ours), ours
    finally:
        run.stop(signal.SIGINT)
        left = run.left_behind()
        run.reap()
        foreign.stop()
    assert left == []
