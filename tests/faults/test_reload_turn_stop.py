"""A worker that stops cleanly (a warm shutdown) while it holds a reload's turn gives it back at
once (workers/batching/strategy.py `DispatcherStep.close`, workers/batching/turns.py): the next
worker on its queues goes now, rather than after the turn's TTL (heartbeat_ttl_s, 10 s, renewed
every heartbeat, so 8 s at the least after the stop). Default settings; the worker's new child is
held loading (the synthetic model's `load_gate`), so that it holds the turn when it stops."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from scripts.stack import ROOT, launch, start_worker, wait_until
from tasks.keys import reload_turn_key

pytestmark = pytest.mark.slow


def test_a_worker_stopped_while_holding_its_turn_gives_it_back_at_once(tmp_path):
    gate = tmp_path / "load-gate"
    gated = {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0, "load_gate": str(gate)}
    stack = launch(tmp_path, {"gated": gated}, {}, defaults=True, ready_models=[])
    reload = None
    try:
        stack.workers["a"] = start_worker("a", stack.env, tmp_path, ["gated"])
        stack.wait_live(["gated"], 180)
        gate.touch()  # from now on a child loading the model waits
        new = tmp_path / "new.yaml"
        new.write_text(yaml.safe_dump({"models": {"gated": {**gated, "version": "v2"}}}))
        reload = subprocess.Popen([sys.executable, "-m", "scripts.reload", str(new)], cwd=ROOT,
                                  env=stack.env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        key = reload_turn_key("gated")
        wait_until(lambda: (stack.redis.get(key) or "").startswith("a@"), 60,
                   "worker a to take its turn")
        os.kill(stack.workers["a"].proc.pid, signal.SIGTERM)  # its main process: warm shutdown
        stopped = time.monotonic()
        wait_until(lambda: stack.redis.get(key) is None, 30, "the turn given back")
        assert time.monotonic() - stopped < 6, "given back at the stop, not lapsed at its TTL"
    finally:
        gate.unlink(missing_ok=True)
        if reload is not None:
            reload.kill()
            reload.wait(10)
        stack.stop()
