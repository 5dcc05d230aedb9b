"""Dynamic batching observed through the API: jobs share model calls, yet a lone job does not
wait, revoked jobs never run, and every job keeps its own result. (A failing job failing
alone is in tests/faults/test_model_faults.py.)"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from config import load_settings
from tasks.celery_app import make_celery
from scripts.stack import wait_until


def test_jobs_submitted_together_share_model_calls(stack):
    with ThreadPoolExecutor(8) as pool:
        jobs = list(pool.map(lambda i: stack.submit("synthetic", [f"job-{i}"]), range(24)))
        done = list(pool.map(lambda j: stack.finished(j["id"]), jobs))
    assert all(d["status"] == "succeeded" for d in done)
    # Each job has its own result, in its own order.
    assert [d["result"]["outputs"] for d in done] == [[len(f"job-{i}")] for i in range(24)]
    batches = {d["batch"]["id"]: d["batch"] for d in done}
    assert len(batches) < len(jobs) / 2, f"{len(batches)} model calls for {len(jobs)} jobs"
    assert max(b["jobs"] for b in batches.values()) > 1
    assert all(b["items"] <= 64 for b in batches.values())


def test_a_lone_job_on_an_idle_worker_does_not_wait_out_the_window(stack):
    # `patient` has a 120 s max_wait_ms; only dispatch-when-idle can finish it within 30 s.
    body = stack.finished(stack.submit("patient", ["alone"])["id"], timeout=30)
    assert body["status"] == "succeeded" and body["batch"]["jobs"] == 1


def test_a_revoked_job_is_dropped_before_its_batch_runs(stack):
    celery = make_celery(load_settings({"redis_url": stack.redis_url,
                                        "models_file": stack.env["IQ_MODELS_FILE"]}))
    blocker = stack.submit("sleepy", ["blocker"])
    wait_until(lambda: stack.job(blocker["id"])["status"] == "running", 20, "blocker to run")
    victim = stack.submit("sleepy", ["victim"])
    celery.control.revoke(victim["id"])
    body = stack.finished(victim["id"], timeout=30)
    assert body["status"] == "cancelled"
    assert body["started_at"] is None and "result" not in body
    assert stack.finished(blocker["id"])["status"] == "succeeded"
