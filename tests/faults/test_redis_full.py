"""Redis memory is bounded: with a maxmemory (and `noeviction`, as `make run` sets it), the API
refuses new jobs with 503 before Redis is full, never a 500, and every job it accepted still
finishes: its results have room."""
from __future__ import annotations

import requests

from scripts.stack import launch, start_worker


def test_a_nearly_full_redis_refuses_new_jobs_and_finishes_the_accepted(tmp_path):
    models = {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0,
                        "max_inputs": 4, "max_input_chars": 4_000}}
    # No worker at first: the accepted jobs wait in Redis, as under a burst.
    stack = launch(tmp_path, models, {}, ready_models=[], defaults=True)
    try:
        server = stack.admin
        used = int(server.info("memory")["used_memory"])
        server.config_set("maxmemory-policy", "noeviction")
        # 10% headroom of this cap is ~0.8 MB: more than a worker holds at once (2 x 16 jobs
        # of ~11 KB), as the headroom must be (README: Reliability).
        server.config_set("maxmemory", used + 6 * 2**20)
        big = ["x" * 2_000] * 4  # ~11 KB a queued job
        accepted, refused = [], None
        for _ in range(1_000):
            r = requests.post(f"{stack.api}/v1/jobs", json={"model": "quick", "inputs": big},
                              timeout=10)
            assert r.status_code in (202, 503), r.text
            if r.status_code == 503:
                refused = r
                break
            accepted.append(r.json()["id"])
        assert refused is not None, "Redis never filled up"
        assert accepted, "nothing was accepted before Redis filled up"
        assert int(refused.headers["Retry-After"]) > 0
        assert refused.json()["error"]["code"] == "unavailable"
        assert "nearly full" in refused.json()["error"]["message"]
        # Every accepted job finishes although Redis stays capped.
        stack.workers["w"] = start_worker("w", stack.env, tmp_path, ["quick"])
        done = [stack.finished(job_id, timeout=60) for job_id in accepted]
        assert {d["status"] for d in done} == {"succeeded"}
        assert all(d["result"]["outputs"] == [2_000] * 4 for d in done)
        # Given memory again, the API accepts jobs again.
        server.config_set("maxmemory", 0)
        stack.finished(stack.submit("quick", ["again"])["id"], timeout=30)
    finally:
        stack.stop()
