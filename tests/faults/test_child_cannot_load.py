"""A worker whose pool child cannot load its model (a corrupt weights file on that host, a GPU
that is gone) must not take jobs and fail them: the jobs are not at fault. The child exits
while it starts, which stops its worker, loudly, with exit status 1 and the reason in one
line (it exited 0, as after an operator's stop, so a keeper or systemd saw no failure); the
jobs wait for a healthy worker."""
from __future__ import annotations

import collections

import pytest
import yaml

from scripts.stack import launch, start_worker, wait_until

pytestmark = pytest.mark.slow

QUICK = {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0, "max_batch_size": 8}
STOPPED = "worker stopped, exit status 1: "


def stopped_with(stack, broken) -> str:
    """Worker `b` started on the broken host's models file (same model name and queue) until
    it stops: its exit status must be 1; the one line that says why."""
    stack.workers["b"] = start_worker(
        "b", dict(stack.env, IQ_MODELS_FILE=str(broken / "models.yaml")), broken, ["quick"])
    wait_until(lambda: stack.workers["b"].proc.poll() is not None, 120,
               "the broken worker to stop")
    assert stack.workers["b"].proc.returncode == 1
    log = stack.workers["b"].log.read_text(errors="replace")
    [line] = [line for line in log.splitlines() if STOPPED in line]
    return line.split(STOPPED, 1)[1]


def test_a_worker_whose_child_failed_to_load_fails_no_job(tmp_path):
    # The broken host: same model name and queue, but its weights file is garbage, so its
    # pool child's load raises (the parent never imports torch, so it starts and consumes).
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "quick.pt").write_bytes(b"not a TorchScript archive")
    (broken / "models.yaml").write_text(yaml.safe_dump({"models": {"quick": {
        "kind": "torchscript", "path": str(broken / "quick.pt"), "input_shape": [1]}}}))

    stack = launch(tmp_path, {"quick": QUICK}, {}, defaults=True, ready_models=[])
    try:
        why = stopped_with(stack, broken)
        assert why.startswith("pool child 0 could not load its models: model quick on cpu: "
                              "RuntimeError: "), why

        ids = [stack.submit("quick", [f"job-{i}"])["id"] for i in range(8)]
        stack.workers["a"] = start_worker("a", stack.env, tmp_path, ["quick"])
        done = [stack.finished(job_id, timeout=120) for job_id in ids]
        statuses = collections.Counter(d["status"] for d in done)
        errors = {d["error"]["message"] for d in done if d.get("error")}
        assert statuses == {"succeeded": 8}, (
            f"jobs failed by a worker whose pool child never loaded its model: {statuses}, "
            f"errors {errors}")
    finally:
        stack.stop()


def test_a_child_whose_load_error_cannot_be_said_still_stops_its_worker(tmp_path):
    """The re-attack of session 14: a load error whose `__str__` raised raised again in the
    child's own handling, which then never stopped: the worker said it was ready with a child
    that had no model, and exited 0 when stopped. The child exits whatever its error."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "models.yaml").write_text(yaml.safe_dump({
        "kinds": ["tests.support.kinds.unsayable"], "models": {"quick": {"kind": "unsayable"}}}))
    stack = launch(tmp_path, {"quick": QUICK}, {}, defaults=True, ready_models=[])
    try:
        assert stopped_with(stack, broken) == (
            "pool child 0 could not load its models: model quick on cpu: "
            "tests.support.kinds.unsayable_handler.Unsayable: <exception str() failed>")
    finally:
        stack.stop()
