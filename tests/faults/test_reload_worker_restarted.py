"""A worker SIGKILLed during a reload and started again by its keeper under a new node name
(make run names a worker by its pid, scripts/worker.sh), default settings, under load: `make
reload` waits for the new worker, which read the new models file as it started, and is done
(scripts/reload_wait.py `Restarts`); every job succeeds, and only the jobs the killed worker was
running ran twice. (Before: the killed worker was "gone: stopped consuming during the reload"
at once, and the reload refused and undone.) The worker's surge child is held loading (the
synthetic model's `load_gate`), so that the kill lands while it reloads."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import yaml

from config.models import revision_of
from scripts.stack import ROOT, launch, start_worker, wait_until
from tasks.keys import reload_turn_key
from tests.faults.test_recovery import running_in
from tests.faults.test_reload_unloadable import instances
from tests.support.load import Load, runs
from tests.support.records import fields_of

pytestmark = pytest.mark.slow


def test_a_worker_killed_in_a_reload_and_restarted_under_a_new_name_is_waited_for(tmp_path):
    gate = tmp_path / "load-gate"
    quick = {"kind": "synthetic", "base_ms": 20, "per_item_ms": 0, "max_batch_size": 4,
             "runs_log": str(tmp_path / "runs.log"), "load_gate": str(gate)}
    stack = launch(tmp_path, {"quick": quick}, {}, defaults=True, ready_models=[])
    load = reload = None
    try:
        stack.workers["first"] = start_worker(f"worker-{os.getpid()}", stack.env, tmp_path, None)
        wait_until(lambda: instances(stack) == 1, 180, "the worker's child loaded")
        load = Load(stack.api, "quick", "load", clients=2, pause_s=0.1).start()
        wait_until(lambda: len(load.accepted) >= 10, 60, "jobs accepted")
        gate.touch()  # from now on a child loading the model waits
        new = tmp_path / "new.yaml"
        new.write_text(yaml.safe_dump({"models": {"quick": {**quick, "version": "v2"}}}))
        reload = subprocess.Popen(
            [sys.executable, "-m", "scripts.reload", str(new), "--timeout", "120"], cwd=ROOT,
            env=stack.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_until(lambda: (stack.redis.get(reload_turn_key("quick")) or "").startswith(
            "worker-"), 60, "the worker's surge child loading the new file")

        # Killed as an out-of-memory killer or `kill -9` kills it: its main process and its
        # children, held first, so that what they were running is known.
        first = stack.workers.pop("first").proc
        os.killpg(first.pid, signal.SIGSTOP)
        may_rerun = running_in(stack, list(load.accepted.values()))
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
        gate.unlink()
        # Its keeper starts it again: a new pid, a new name, the same host and queues.
        stack.workers["again"] = start_worker(f"worker-{os.getpid() + 1}", stack.env,
                                              tmp_path, None)
        said, _ = reload.communicate(timeout=300)
        assert reload.returncode == 0, said
        assert "restarted as worker:worker-" in said and "reload done" in said, said
        assert revision_of((tmp_path / "models.yaml").read_bytes()) == revision_of(
            new.read_bytes())

        load.stop()
        assert load.gave_up == [] and len(load.accepted) > 10
        for job_id in load.accepted.values():
            stack.finished(job_id, timeout=90)
        records = fields_of(stack.redis, list(load.accepted.values()))
        assert {r["status"] for r in records.values()} == {"succeeded"}
        ran = runs(tmp_path / "runs.log")
        counted = {job_id: ran[text] for text, job_id in load.accepted.items()}
        assert all(n >= 1 for n in counted.values()), "a succeeded job never ran"
        twice = {job_id for job_id, n in counted.items() if n > 1}
        assert twice <= may_rerun, f"{len(twice - may_rerun)} job(s) ran twice outside the " \
                                   "killed worker's batch"
    finally:
        gate.unlink(missing_ok=True)
        if load is not None:
            load.stop()
        if reload is not None and reload.poll() is None:
            reload.kill()
            reload.wait(10)
        stack.stop()
