"""A worker's prefetch, on real workers and Redis: two full batches per child of the largest
model it serves (workers/batching/prefetch.py). A worker started with -Q for a model of batch 4,
beside one of batch 32 in the file, once held 64 jobs a child (all 30 waiting here) where
another worker could have run them; a worker consuming every queue follows a reload that adds
a bigger model, keeps it over a reconnect, and lowers it when the reload removes it."""
from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
import yaml

from scripts.stack import ROOT, launch, start_worker, wait_until
from tests.support.records import fields_of
from tests.support.workers import prefetch_count
from workers.broker.lua import INFLIGHT_PREFIX

pytestmark = pytest.mark.slow

# A batch of tiny (four one-input jobs) takes 2.5 s: the worker holds what it fetched that
# long, for the test to read.
TINY = {"kind": "synthetic", "base_ms": 2500, "per_item_ms": 0, "max_batch_size": 4}
WIDE = {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0, "max_batch_size": 32}
FINAL = {"succeeded", "failed", "cancelled", "expired"}


def reload(stack, models: dict) -> None:
    path = stack.workdir / f"new-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump({"models": models}))
    done = subprocess.run([sys.executable, "-m", "scripts.reload", str(path), "--timeout", "240"],
                          cwd=ROOT, env=stack.env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_worker_on_a_small_models_queue_holds_two_of_its_batches_per_child(tmp_path):
    stack = launch(tmp_path, {"tiny": TINY, "wide": WIDE}, {}, ready_models=[])
    try:
        ids = [stack.submit("tiny", [f"t{i}"])["id"] for i in range(30)]  # before any worker
        stack.workers["s"] = start_worker("s", stack.env, tmp_path, ["tiny"], concurrency=2)
        admin, held = stack.admin, []

        def finished() -> bool:
            """Every job final; meanwhile what the worker holds (its in-flight hash: fetched,
            not yet acknowledged), sampled."""
            held.append(sum(admin.hlen(k) for k in admin.scan_iter(f"{INFLIGHT_PREFIX}*")))
            return all(r.get("status") in FINAL for r in fields_of(stack.redis, ids).values())

        wait_until(finished, 180, "tiny's 30 jobs to finish")
        records = fields_of(stack.redis, ids)
        assert {r["status"] for r in records.values()} == {"succeeded"}
        # 2 children x 2 batches of 4: all it ever held, and all it held while jobs waited
        # (a worker sized by wide's 32 took all 30 in its first fetch).
        assert max(held) == 2 * 4 * 2, held
        assert prefetch_count(stack, "s") == 2 * 4 * 2
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop()


def test_a_reload_moves_a_consume_all_workers_prefetch_which_a_reconnect_keeps(tmp_path):
    stack = launch(tmp_path, {"tiny": TINY}, {"all": None})
    try:
        assert prefetch_count(stack, "all") == 2 * 4
        reload(stack, {"tiny": TINY, "wide": WIDE})  # its queue consumed: a worker without -Q
        assert prefetch_count(stack, "all") == 2 * 32
        # Its consumer's connection cut (idle, it waits in BRPOP on its wake-up lists): the
        # QoS the reconnect sets up is the raised one.
        admin = stack.admin
        fetching = [c for c in admin.client_list() if c.get("cmd") in ("brpop", "evalsha")]
        assert fetching, admin.client_list()
        for client in fetching:
            admin.client_kill_filter(_id=client["id"])
        log = stack.workers["all"].log
        wait_until(lambda: "Connection to broker lost" in log.read_text(), 60,
                   "the worker to see its connection gone")
        wait_until(lambda: "Connected to" in log.read_text().rpartition(
            "Connection to broker lost")[2], 60, "the worker to reconnect")
        assert prefetch_count(stack, "all") == 2 * 32
        job = stack.finished(stack.submit("wide", ["w"])["id"], timeout=120)
        assert job["status"] == "succeeded", job
        reload(stack, {"tiny": TINY})  # wide removed: its queue stays consumed, not counted
        assert prefetch_count(stack, "all") == 2 * 4
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop()
