"""Scaling with the celery CLI: workers sharing a queue, moving a worker between model queues,
inspecting buffered jobs, and the one-child-per-GPU rule."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
import requests

from scripts.stack import ROOT, launch, start_worker, wait_until
from tests.support.records import fields

MODELS = {
    "shared": {"kind": "synthetic", "base_ms": 1000, "per_item_ms": 0, "max_batch_size": 2,
               "max_inputs": 2},
    "extra": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0},
}


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("scaling")
    # A worker holds two jobs at most (one a batch here), so that a burst of jobs cannot
    # mostly land in one worker's fetch: by default it holds two full batches per child of
    # the largest model it serves ("shared": four jobs), half the burst. (Before the prefetch
    # was sized by the models a worker serves, it was by "extra", 64 jobs, and whichever
    # worker fetched first took all eight.)
    stack = launch(workdir, MODELS, {}, ready_models=[],
                   env_extra={"IQ_PREFETCH_MULTIPLIER": "2"})
    try:
        # Worker "a" believes its host has one GPU: its pool may not grow past one child.
        stack.workers["a"] = start_worker("a", dict(stack.env, IQ_GPU_COUNT="1"), workdir,
                                          ["shared"])
        stack.workers["b"] = start_worker("b", stack.env, workdir, ["shared"])
        # Both workers serving before any test submits: a worker fetches nothing until its
        # pool child has loaded the model, and one whose child loads late (a loaded machine)
        # finds the other worker has taken every job. A ping is answered before that.
        stack.wait_live(["shared"], 120, instances=2)
        wait_until(lambda: celery(stack, "inspect", "ping", "-d", f"{node('a')},{node('b')}")
                   .count("pong") == 2, 60, "both workers to answer")
        yield stack
    finally:
        stack.stop()


def node(name: str) -> str:
    return f"{name}@{socket.gethostname()}"


def celery(stack, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "celery", "-A", "tasks.cli", *args],
                         cwd=ROOT, env=stack.env, capture_output=True, text=True, timeout=60)
    return out.stdout + out.stderr


def inspect_json(stack, what: str, name: str) -> list:
    out = celery(stack, "inspect", what, "-d", node(name), "--json", "-t", "5")
    line = next(line for line in out.splitlines() if line.startswith("{"))
    return json.loads(line)[node(name)]


def test_two_workers_with_different_node_names_share_one_queue(scaled):
    jobs = [scaled.submit("shared", ["x", "y"]) for _ in range(8)]
    done = [scaled.finished(j["id"], timeout=60) for j in jobs]
    assert all(d["status"] == "succeeded" for d in done)
    nodes = {fields(scaled.redis, j['id']).get("worker").split("/")[0] for j in jobs}
    assert nodes == {node("a"), node("b")}


def test_inspect_shows_buffered_and_running_jobs(scaled):
    # Stop b consuming so that a alone holds everything.
    assert "OK" in celery(scaled, "control", "cancel_consumer", "shared", "-d", node("b"))
    try:
        # A batch is one job of 1 s: twenty keep a busy for 20 s, long enough for the
        # inspections (a celery command each) to find jobs running and waiting behind on a
        # loaded machine; with four, a slow start found them all finished.
        jobs = [scaled.submit("shared", ["x", "y"]) for _ in range(20)]

        def held() -> tuple[dict, dict] | None:
            """What a runs, then what waits in its buffer (in that order: a job waiting now
            cannot have run before); None until both are there (b may still answer the fetch
            it had sent before it stopped consuming, and a loaded worker fills its buffer a
            moment after its first batch starts)."""
            active = {t["id"]: t for t in inspect_json(scaled, "active", "a")}
            reserved = {t["id"]: t for t in inspect_json(scaled, "reserved", "a")}
            return (active, reserved) if active and reserved else None

        active, reserved = wait_until(held, 40, "a batch running on a and jobs held behind it")
        ids = {j["id"] for j in jobs}
        # One batch (one job) runs, the jobs behind it wait in the worker's buffer.
        assert len(active) == 1 and set(active) <= ids
        assert reserved and set(reserved) <= ids and not set(reserved) & set(active)
        assert all(t["name"] == "iq.infer.shared"
                   for t in [*active.values(), *reserved.values()])
        for job in jobs:
            assert scaled.finished(job["id"], timeout=60)["status"] == "succeeded"
    finally:
        celery(scaled, "control", "add_consumer", "shared", "-d", node("b"))


def test_add_and_cancel_consumer_move_a_worker_between_model_queues(scaled):
    assert "OK" in celery(scaled, "control", "add_consumer", "extra", "-d", node("b"))
    body = scaled.finished(scaled.submit("extra", ["moved"])["id"], timeout=120)
    assert body["status"] == "succeeded"
    assert fields(scaled.redis, body['id']).get("worker").startswith(node("b"))
    queues = {q["name"] for q in inspect_json(scaled, "active_queues", "b")}
    assert "extra" in queues

    def readiness() -> tuple[int, int]:
        """extra's live instances as /readyz and /v1/models count them."""
        ready = requests.get(f"{scaled.api}/readyz", timeout=5).json()
        models = requests.get(f"{scaled.api}/v1/models", timeout=5).json()["models"]
        listed = next(m for m in models if m["name"] == "extra")
        return ready["checks"]["model:extra"]["instances"], listed["instances"]

    assert readiness() == (1, 1)
    asked = time.monotonic()
    assert "OK" in celery(scaled, "control", "cancel_consumer", "extra", "-d", node("b"))
    # Readiness follows within a heartbeat or two (2 s each) of the command's answer, not
    # the 20 s of a lost heartbeat.
    wait_until(lambda: readiness() == (0, 0), 10, "extra no longer counted as live")
    print(f"readiness followed cancel_consumer in {time.monotonic() - asked:.1f} s")
    ready = requests.get(f"{scaled.api}/readyz", timeout=5)
    assert ready.status_code == 503 and ready.json()["checks"]["model:extra"]["ok"] is False
    queues = {q["name"] for q in inspect_json(scaled, "active_queues", "b")}
    assert "extra" not in queues
    orphan = scaled.submit("extra", ["nobody"])
    assert scaled.job(orphan["id"], wait=2)["status"] == "queued"


def test_growing_a_gpu_workers_pool_beyond_its_devices_is_refused(scaled):
    celery(scaled, "control", "pool_grow", "1", "-d", node("a"))
    wait_until(lambda: "refusing to grow the pool" in scaled.workers["a"].log.read_text(),
               20, "the refusal in the worker's log")
    stats = inspect_json(scaled, "stats", "a")
    assert stats["pool"]["max-concurrency"] == 1
    assert len(stats["pool"]["processes"]) == 1
