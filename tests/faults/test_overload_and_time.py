"""Backpressure, deadlines, hard time limits, cancellation, priority and idempotency."""
from __future__ import annotations

import uuid

import requests

from scripts.stack import wait_until
from tests.faults.conftest import blocked
from tests.support.records import fields


def post(stack, body, headers=None):
    return requests.post(f"{stack.api}/v1/jobs", json=body, headers=headers, timeout=10)


def test_a_full_queue_answers_429_and_stays_bounded(faults):
    codes = [post(faults, {"model": "orphan", "inputs": ["x"]}).status_code for _ in range(20)]
    assert codes[:5] == [202] * 5 and set(codes[5:]) == {429}
    r = post(faults, {"model": "orphan", "inputs": ["x"]})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["code"] == "overloaded"
    depth = sum(faults.redis.llen(q) for q in faults.redis.scan_iter("orphan*"))
    assert depth == 5
    # Other models are not affected by one model's full queue.
    assert post(faults, {"model": "quick", "inputs": ["x"]}).status_code == 202


def test_a_job_not_started_by_its_deadline_expires_and_never_runs(faults):
    # The child busy for 6 s: the late job's 0.5 s pass while it waits, however long its post
    # took on a loaded machine.
    blocker = blocked(faults)
    late = faults.submit("sleepy", ["late"], timeout_s=0.5)
    follower = faults.submit("sleepy", ["after"] * 4)  # queued behind late
    body = faults.finished(late["id"], timeout=30)
    assert body["status"] == "expired" and body["error"]["code"] == "expired"
    assert body["started_at"] is None
    assert faults.finished(blocker["id"])["status"] == "succeeded"
    # Still expired, and never started, once the worker has gone past it.
    assert faults.finished(follower["id"], timeout=30)["status"] == "succeeded"
    again = faults.job(late["id"])
    assert again["status"] == "expired" and again["started_at"] is None
    assert fields(faults.redis, late['id']).get("runs") is None


def test_a_job_past_its_hard_limit_fails_with_timeout_and_the_child_is_replaced(faults):
    job = faults.submit("hang", ["x"])
    body = faults.finished(job["id"], timeout=60)
    assert body["status"] == "failed" and body["error"]["code"] == "timeout"
    first_pid = fields(faults.redis, job['id']).get("worker").rsplit("/", 1)[1]
    after = faults.finished(faults.submit("quick", ["y"])["id"], timeout=120)
    assert after["status"] == "succeeded"
    new_pid = fields(faults.redis, after['id']).get("worker").rsplit("/", 1)[1]
    assert new_pid != first_pid
    assert faults.workers["faults"].proc.poll() is None


def test_cancel_a_queued_job_it_never_runs(faults):
    blocker = blocked(faults)  # the victim is still queued at its cancel, however slow the posts
    victim = faults.submit("sleepy", ["v"])
    r = requests.post(f"{faults.api}/v1/jobs/{victim['id']}/cancel", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert faults.finished(blocker["id"])["status"] == "succeeded"
    # After the worker reached it, it is still cancelled and never ran.
    follow = faults.finished(faults.submit("sleepy", ["after"])["id"], timeout=30)
    assert follow["status"] == "succeeded"
    body = faults.job(victim["id"])
    assert body["status"] == "cancelled" and body["started_at"] is None
    assert "result" not in body


def test_cancel_a_running_or_finished_job_is_409_with_its_status(faults):
    job = faults.submit("sleepy", ["r"])
    wait_until(lambda: faults.job(job["id"])["status"] == "running", 20, "job to run")
    r = requests.post(f"{faults.api}/v1/jobs/{job['id']}/cancel", timeout=10)
    assert r.status_code == 409 and r.json()["error"]["status"] == "running"
    assert r.json()["error"]["message"] == "the job is running and can no longer be cancelled"
    # Nor deleted yet, and the answer does not send the caller to a cancel that cannot be (the
    # outside attack of session 13 got "cancel it first", then the 409 above).
    r = requests.delete(f"{faults.api}/v1/jobs/{job['id']}", timeout=10)
    assert r.status_code == 409 and r.json()["error"]["status"] == "running"
    assert r.json()["error"]["message"] == "the job is running: delete it once it finishes " \
                                           "(a running job cannot be cancelled)"
    assert faults.finished(job["id"])["status"] == "succeeded"
    r = requests.post(f"{faults.api}/v1/jobs/{job['id']}/cancel", timeout=10)
    assert r.status_code == 409 and r.json()["error"]["status"] == "succeeded"
    assert r.json()["error"]["message"] == "the job has succeeded and can no longer be cancelled"
    r = requests.post(f"{faults.api}/v1/jobs/{uuid.uuid4()}/cancel", timeout=10)
    assert r.status_code == 404


def test_high_priority_jobs_are_served_first_despite_prefetching(faults):
    # Seven posts, one after another, all in the worker's buffer before the child is free.
    blocked(faults)
    low = [faults.submit("sleepy", [f"low{i}"], priority="low") for i in range(6)]
    high = faults.submit("sleepy", ["high"], priority="high")
    done_high = faults.finished(high["id"], timeout=60)
    done_low = [faults.finished(j["id"], timeout=60) for j in low]
    assert done_high["status"] == "succeeded"
    assert done_high["started_at"] <= min(d["started_at"] for d in done_low)
    # The first batch after the blocker holds the high job and the oldest low ones.
    assert done_high["batch"]["id"] == done_low[0]["batch"]["id"]
    assert done_low[-1]["batch"]["id"] != done_high["batch"]["id"]


def test_priority_must_be_known(faults):
    r = post(faults, {"model": "quick", "inputs": ["x"], "priority": "urgent"})
    assert r.status_code == 422 and "priority" in r.json()["error"]["fields"]


def test_a_retried_post_with_the_same_idempotency_key_returns_the_same_job(faults):
    key = f"order-{uuid.uuid4()}"
    body = {"model": "quick", "inputs": ["same"]}
    first = post(faults, body, {"Idempotency-Key": key})
    second = post(faults, body, {"Idempotency-Key": key})
    assert first.status_code == second.status_code == 202
    assert first.json()["id"] == second.json()["id"]
    other = post(faults, body)
    assert other.json()["id"] != first.json()["id"]
    clash = post(faults, {"model": "quick", "inputs": ["different"]}, {"Idempotency-Key": key})
    assert clash.status_code == 409 and clash.json()["error"]["code"] == "conflict"
    assert faults.finished(first.json()["id"])["status"] == "succeeded"
