"""A pool child restarted after a crash loads the models its worker serves, not whatever the
models file on disk says by then. `make reload` without FILE reloads the file as it is, so an
operator edits it first: until the reload is announced, a child that crashed and was started
again read the edited file. A model removed there was missing in the child though its worker
still routed it jobs (the child's load failed and the whole worker stopped), and a model
whose version changed ran its new version while the worker, /v1/models and the revision said
the old one."""
from __future__ import annotations

import os
import signal

import pytest
import yaml

from scripts.stack import launch, wait_until
from tests.support.records import fields

pytestmark = pytest.mark.slow

QUICK = {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0, "max_batch_size": 4}
SERVED = {"quick": {**QUICK, "version": "v1"}, "other": {**QUICK, "version": "o1"}}


def test_a_child_started_again_loads_the_served_models_not_an_unannounced_edit(tmp_path):
    stack = launch(tmp_path, SERVED, {"a": None}, defaults=True)
    try:
        first = stack.finished(stack.submit("quick", ["before"])["id"])
        assert first["status"] == "succeeded" and first["model_version"] == "v1"
        child = int(fields(stack.redis, first['id']).get("worker").rsplit("/", 1)[1])
        # The operator's edit, not yet announced: `other` removed, `quick` a new version.
        (tmp_path / "models.yaml").write_text(yaml.safe_dump(
            {"models": {"quick": {**QUICK, "version": "v2"}}}))
        os.kill(child, signal.SIGKILL)  # the crash; the pool starts another child
        done = {m: stack.finished(stack.submit(m, [f"after-{m}"])["id"], timeout=60)
                for m in ("quick", "other")}
        assert stack.workers["a"].proc.poll() is None, stack.workers["a"].tail(200)
        assert {m: (d["status"], d["model_version"]) for m, d in done.items()} == {
            "quick": ("succeeded", "v1"), "other": ("succeeded", "o1")}
        assert "could not load its models" not in stack.workers["a"].tail(500)
    finally:
        stack.stop()
