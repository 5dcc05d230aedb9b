"""A stack of synthetic models for fault tests: quick to start, each model a fault to provoke."""
from __future__ import annotations

import pytest

from scripts.stack import Stack, launch, wait_until

FAULT_MODELS = {
    "quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0, "max_batch_size": 16},
    "sleepy": {"kind": "synthetic", "base_ms": 2000, "per_item_ms": 0, "max_batch_size": 4,
               "max_inputs": 4},
    "oomy": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0, "max_batch_size": 16,
             "oom_above": 4},
    "hang": {"kind": "synthetic", "base_ms": 8000, "per_item_ms": 0, "time_limit_s": 1},
    # Holds the worker's one child while a test posts what must wait behind it: 6 s, where
    # sleepy's 2 s left a loaded machine too little time to post several jobs.
    "blocker": {"kind": "synthetic", "base_ms": 6000, "per_item_ms": 0},
    # No worker consumes this queue: it only fills, up to its depth.
    "orphan": {"kind": "synthetic", "max_queue_depth": 5},
}
SERVED = ["quick", "sleepy", "oomy", "hang", "blocker"]


def blocked(stack: Stack) -> dict:
    """A `blocker` job running on the faults worker's one child: jobs posted in the next 6 s
    wait in the worker's buffer behind it, however slowly a loaded machine posts them."""
    blocker = stack.submit("blocker", ["b"])
    wait_until(lambda: stack.job(blocker["id"])["status"] == "running", 20, "the blocker")
    return blocker


def fault_stack(workdir, **kw):
    return launch(workdir, FAULT_MODELS, {"faults": SERVED}, ready_models=SERVED, **kw)


@pytest.fixture(scope="session")
def faults(tmp_path_factory):
    stack = fault_stack(tmp_path_factory.mktemp("faults"))
    yield stack
    stack.stop()
