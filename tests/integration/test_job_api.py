"""The job API beyond submit and read, over HTTP on the shared stack: listing (filters, pages,
the dead-letter view), retry, delete, progress, and a job's events as Server-Sent Events."""
from __future__ import annotations

import re
import uuid

import pytest
import requests

from scripts.stack import wait_until
from tests.support.sse import events_of

POISON = [[1, 2, 3, -5000]]  # ts-affine raises on any input below -1000


def post(stack, path: str, **kw) -> requests.Response:
    return requests.post(f"{stack.api}{path}", timeout=10, **kw)


def listed(stack, **query) -> dict:
    r = requests.get(f"{stack.api}/v1/jobs", params=query, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def blocked(stack) -> dict:
    """A sleepy job running on the synthetic models' worker: what is queued behind it for
    the next 3 s can be cancelled before it runs."""
    blocker = stack.submit("sleepy", ["block"])
    wait_until(lambda: stack.job(blocker["id"])["status"] == "running", 30, "the blocker")
    return blocker


def test_the_list_pages_through_the_callers_jobs_newest_first_without_outputs(stack):
    made = [stack.submit("ts-affine", [[i, 0, 0, 0]])["id"] for i in range(3)]
    for job_id in made:
        stack.finished(job_id)
    first = listed(stack, model="ts-affine", limit=2)
    assert [j["id"] for j in first["jobs"]] == made[::-1][:2]
    assert first["next"] == f"/v1/jobs?model=ts-affine&limit=2&cursor={first['next_cursor']}"
    second = requests.get(f"{stack.api}{first['next']}", timeout=10).json()
    assert second["jobs"][0]["id"] == made[0]
    for job in first["jobs"] + second["jobs"][:1]:  # older ones are other tests' jobs
        assert job["model"] == "ts-affine" and "result" not in job
        assert job["status"] == "succeeded" and job["progress"] == {"items_done": 1, "items": 1}
    assert {j["model"] for j in listed(stack, model="ts-affine", limit=100)["jobs"]} \
        == {"ts-affine"}


@pytest.mark.parametrize("query, field", [
    ({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"status": "done"}, "status"),
    ({"model": "no-such-model"}, "model"), ({"cursor": "yesterday"}, "cursor")])
def test_a_bad_list_query_is_422_naming_it(stack, query, field):
    r = requests.get(f"{stack.api}/v1/jobs", params=query, timeout=10)
    assert r.status_code == 422 and field in r.json()["error"]["fields"], r.text


def test_the_dead_letter_view_lists_failed_jobs_and_their_kept_requests_count(stack):
    failed = stack.finished(stack.submit("ts-affine", POISON)["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == "inference_error"
    dead = listed(stack, status="failed", limit=100)["jobs"]
    assert dead[0]["id"] == failed["id"] and {j["status"] for j in dead} == {"failed"}
    metrics = requests.get(f"{stack.api}/metrics", timeout=10).text
    kept = re.search(r"^iq_kept_requests (\S+)$", metrics, re.M)
    size = re.search(r"^iq_kept_request_bytes (\S+)$", metrics, re.M)
    assert kept and float(kept.group(1)) >= 1 and size and float(size.group(1)) > 0


def test_a_failed_job_is_retried_with_its_inputs_as_a_new_linked_job(stack):
    failed = stack.finished(stack.submit("ts-affine", POISON)["id"])
    r = post(stack, f"/v1/jobs/{failed['id']}/retry")
    assert r.status_code == 202, r.text
    again = r.json()
    assert r.headers["Location"] == f"/v1/jobs/{again['id']}" == again["url"]
    assert again["retry_of"] == failed["id"] and again["id"] != failed["id"]
    assert stack.job(failed["id"])["retried_as"] == again["id"]
    ran = stack.finished(again["id"])  # the same poison input: the same failure
    assert ran["status"] == "failed" and ran["error"] == failed["error"]
    twice = post(stack, f"/v1/jobs/{failed['id']}/retry")
    assert twice.status_code == 409 and twice.json()["error"]["retried_as"] == again["id"]


def test_a_cancelled_job_is_retried_with_its_model_inputs_and_options(stack):
    blocked(stack)
    inputs = [f"text {i}" for i in range(5)]
    victim = stack.submit("chunky", inputs, priority="low")
    assert post(stack, f"/v1/jobs/{victim['id']}/cancel").json()["status"] == "cancelled"
    again = post(stack, f"/v1/jobs/{victim['id']}/retry").json()
    done = stack.finished(again["id"])
    direct = stack.finished(stack.submit("chunky", inputs, priority="low")["id"])
    assert done["status"] == "succeeded" and done["model"] == "chunky"
    assert done["result"] == direct["result"] and len(done["result"]["outputs"]) == 5


def test_a_retry_is_refused_for_a_success_and_for_a_request_too_large_to_keep(stack):
    ok = stack.finished(stack.submit("ts-affine", [[1, 2, 3, 4]])["id"])
    r = post(stack, f"/v1/jobs/{ok['id']}/retry")
    assert r.status_code == 409 and r.json()["error"]["status"] == "succeeded"
    assert r.json()["error"]["message"].startswith("the job has succeeded: only a job that")
    blocked(stack)
    big = stack.submit("synthetic", ["x" * 5000] * 64)  # 320 kB: over the 256 KiB kept
    post(stack, f"/v1/jobs/{big['id']}/cancel")
    r = post(stack, f"/v1/jobs/{big['id']}/retry")
    assert r.status_code == 409 and "IQ_KEPT_INPUTS_MAX_BYTES" in r.json()["error"]["message"]
    assert post(stack, f"/v1/jobs/{uuid.uuid4()}/retry").status_code == 404


def test_delete_removes_a_finished_job_and_refuses_one_that_waits(stack):
    blocked(stack)
    waiting = stack.submit("chunky", ["wait"])
    r = requests.delete(f"{stack.api}/v1/jobs/{waiting['id']}", timeout=10)
    assert r.status_code == 409 and r.json()["error"]["status"] == "queued"
    assert "cancel it first" in r.json()["error"]["message"]
    done = stack.finished(waiting["id"])
    r = requests.delete(f"{stack.api}{done['url']}", timeout=10)
    assert r.status_code == 204 and r.content == b""
    assert requests.get(f"{stack.api}{done['url']}", timeout=10).status_code == 404
    assert done["id"] not in [j["id"] for j in listed(stack, model="chunky", limit=100)["jobs"]]
    assert requests.delete(f"{stack.api}{done['url']}", timeout=10).status_code == 404


def test_a_job_spanning_several_model_calls_streams_its_progress(stack):
    """16 inputs of a model that takes 2 a call: 8 calls, each counted as it ends."""
    job = stack.submit("chunky", [f"item {i}" for i in range(16)])
    with requests.get(f"{stack.api}/v1/jobs/{job['id']}/events", stream=True,
                      timeout=60) as stream:
        assert stream.status_code == 200
        assert stream.headers["Content-Type"].startswith("text/event-stream")
        events = events_of(stream.iter_lines(decode_unicode=True))
    names = [name for name, _id, _job in events]
    assert names[-1] == "succeeded" and names.count("succeeded") == 1
    assert names[0] in ("queued", "running")
    done = [body["progress"]["items_done"] for name, _id, body in events if name == "progress"]
    assert len(done) >= 2 and done == sorted(done) and 0 < done[0] and done[-1] < 16
    final = events[-1][2]
    assert final["progress"] == {"items_done": 16, "items": 16}
    assert len(final["result"]["outputs"]) == 16
    assert stack.job(job["id"])["progress"] == {"items_done": 16, "items": 16}


def test_an_event_stream_resumes_after_the_last_event_seen_and_ends_with_204(stack):
    job = stack.finished(stack.submit("ts-affine", [[1, 2, 3, 4]])["id"])
    url = f"{stack.api}/v1/jobs/{job['id']}/events"
    replay = events_of(requests.get(url, headers={"Last-Event-ID": "running"},
                                    timeout=10).iter_lines(decode_unicode=True))
    assert [(name, ident) for name, ident, _ in replay] == [("succeeded", "succeeded")]
    assert replay[0][2]["result"] == job["result"]
    r = requests.get(url, headers={"Last-Event-ID": "succeeded"}, timeout=10)
    assert r.status_code == 204  # an EventSource stops reconnecting
    assert requests.get(f"{stack.api}/v1/jobs/{uuid.uuid4()}/events",
                        timeout=10).status_code == 404
