"""A stack of synthetic models for fault tests: quick to start, each model a fault to provoke."""
from __future__ import annotations

import pytest

from scripts.stack import launch

FAULT_MODELS = {
    "quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0, "max_batch_size": 16},
    "sleepy": {"kind": "synthetic", "base_ms": 2000, "per_item_ms": 0, "max_batch_size": 4,
               "max_inputs": 4},
    "oomy": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0, "max_batch_size": 16,
             "oom_above": 4},
    "hang": {"kind": "synthetic", "base_ms": 8000, "per_item_ms": 0, "time_limit_s": 1},
    # No worker consumes this queue: it only fills, up to its depth.
    "orphan": {"kind": "synthetic", "max_queue_depth": 5},
}
SERVED = ["quick", "sleepy", "oomy", "hang"]


def fault_stack(workdir, **kw):
    return launch(workdir, FAULT_MODELS, {"faults": SERVED}, ready_models=SERVED, **kw)


@pytest.fixture(scope="session")
def faults(tmp_path_factory):
    stack = fault_stack(tmp_path_factory.mktemp("faults"))
    yield stack
    stack.stop()
