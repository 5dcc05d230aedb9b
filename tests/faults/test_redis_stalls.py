"""Redis in trouble, on the default settings a user runs (make run's Redis: append-only file),
under load from the project's Python client: frozen for 10 s, frozen for 45 s (past the 30 s
visibility timeout), and killed with SIGKILL, then restarted.

Each counts, per job id: lost (accepted, never succeeded), failed, run twice, and jobs no
client was told about (a submit left unanswered that still made a record), and names the
slowest answer to a submit. While Redis is away, every submit is answered within the Redis
deadline (503 with Retry-After, never held), `/readyz` fails and `/healthz` stays 200.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
from typing import Callable

import pytest
import requests
from inference_queue_client import Client

from config import Settings
from scripts.stack import Stack, launch, start_redis, wait_until
from tests.support.load import Load, every_record, job_statuses, runs

pytestmark = pytest.mark.slow

DEADLINE_S = Settings.redis_deadline_s
# The answer's own slack beyond the deadline on a loaded two-core machine.
SLACK_S = 1.5
RECOVERY_S = 60
# What one worker holds (buffered or running) on the defaults: two full batches per child.
HELD = 2 * 8


@pytest.fixture(scope="module")
def stalled(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("stalls")
    log = workdir / "runs.log"
    models = {"slow": {"kind": "synthetic", "base_ms": 100, "per_item_ms": 0,
                       "max_batch_size": 8, "max_inputs": 1, "runs_log": str(log)},
              # One job of it runs through the start of a freeze, a request waiting on it.
              "long": {"kind": "synthetic", "base_ms": 3000, "per_item_ms": 0}}
    stack = launch(workdir, models, {"w": ["slow", "long"]}, appendonly=True, defaults=True)
    yield stack, log
    stack.stop()


def probe_while_away(stack: Stack, away_s: float,
                     known: str) -> list[tuple[int, float, int, float]]:
    """/readyz and /healthz, asked in turn while Redis is away: (status, seconds) of each.
    First a read and a cancel of the `known` job: each a 503 with Retry-After within the
    deadline."""
    for method in ("GET", "DELETE"):
        asked = time.monotonic()
        r = requests.request(method, f"{stack.api}/v1/jobs/{known}", timeout=30)
        assert time.monotonic() - asked < DEADLINE_S + SLACK_S, method
        assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0, (method, r.text)
    probes = []
    until = time.monotonic() + away_s - DEADLINE_S - SLACK_S
    while time.monotonic() < until:
        asked = time.monotonic()
        ready = requests.get(f"{stack.api}/readyz", timeout=30)
        answered = time.monotonic()
        health = requests.get(f"{stack.api}/healthz", timeout=30)
        probes.append((ready.status_code, answered - asked,
                       health.status_code, time.monotonic() - answered))
        assert ready.json()["checks"]["redis"] == {"ok": False, "error": "unreachable"}
        time.sleep(0.5)
    return probes


def unanswered_submit(stack: Stack) -> tuple[str, str]:
    """A submit with an Idempotency-Key while Redis is away: 503 within the deadline, naming
    the job it may have recorded. Returns (key, that job's id)."""
    key = str(uuid.uuid4())
    asked = time.monotonic()
    r = requests.post(f"{stack.api}/v1/jobs", json={"model": "slow", "inputs": ["keyed"]},
                      headers={"Idempotency-Key": key}, timeout=30)
    assert time.monotonic() - asked < DEADLINE_S + SLACK_S
    # Retry-After 0: Redis took the submit and did not answer; the resend is safe and bounded.
    assert r.status_code == 503 and r.headers["Retry-After"] == "0", r.text
    error = r.json()["error"]
    assert "may have been recorded" in error["message"] and "Idempotency-Key" in error["message"]
    return key, error["job_id"]


def resent(stack: Stack, key: str, job_id: str) -> str:
    """The same submit resent once Redis is back: the job the first one recorded, or (if it
    recorded none) a new one, the first id then unknown. Never two jobs."""
    r = requests.post(f"{stack.api}/v1/jobs", json={"model": "slow", "inputs": ["keyed"]},
                      headers={"Idempotency-Key": key}, timeout=30)
    assert r.status_code == 202, r.text
    if r.json()["id"] != job_id:
        assert requests.get(f"{stack.api}/v1/jobs/{job_id}", timeout=10).status_code == 404
    return r.json()["id"]


def counted(stack: Stack, log, load: Load, since: float, back: float,
            extra: set[str]) -> dict[str, int]:
    """Once every accepted job is final (or RECOVERY_S has passed): what happened to them, per
    job id."""
    ids = list(load.accepted.values())
    try:
        wait_until(lambda: set(job_statuses(stack.redis, ids).values())
                   <= {"succeeded", "failed"},
                   RECOVERY_S, f"all {len(ids)} accepted jobs final within {RECOVERY_S}s")
    except TimeoutError:
        pass  # counted below as lost
    statuses = job_statuses(stack.redis, ids)
    ran = runs(log)
    tally = {
        "accepted": len(ids),
        "lost": sum(1 for s in statuses.values() if s != "succeeded" and s != "failed"),
        "failed": sum(1 for s in statuses.values() if s == "failed"),
        "twice": sum(1 for text in load.accepted if ran[text] > 1),
        "never_ran": sum(1 for text in load.accepted if ran[text] == 0),
        "unknown_records": len(every_record(stack.admin) - set(ids) - extra),
        "gave_up": len(load.gave_up),
        "final_after_s": round(time.monotonic() - back, 1),
        "slowest_submit_s": round(load.slowest(since), 2),
    }
    print(f"{load.tag}: {tally}; answers {dict(load.statuses())}")
    return tally


def freeze(stalled, seconds: float, tag: str,
           first: Callable[[], None] = lambda: None) -> dict[str, int]:
    """Freeze Redis for `seconds` under load (`first` run just before) and count."""
    stack, log = stalled
    before = every_record(stack.admin)
    load = Load(stack.api, "slow", tag).start()
    wait_until(lambda: len(load.accepted) >= 40, 60, "load under way")
    first()
    pid = stack.redis_svc.proc.pid
    os.kill(pid, signal.SIGSTOP)  # a stall: connections stay open, nothing answers
    frozen = time.monotonic()
    try:
        key, maybe = unanswered_submit(stack)
        probes = probe_while_away(stack, seconds - (time.monotonic() - frozen),
                                  list(load.accepted.values())[0])
        time.sleep(max(frozen + seconds - time.monotonic(), 0))
    finally:
        os.kill(pid, signal.SIGCONT)
    back = time.monotonic()
    assert all(ready == 503 and took < DEADLINE_S + SLACK_S and health == 200 and hs < 1
               for ready, took, health, hs in probes), probes
    wait_until(lambda: requests.get(f"{stack.api}/readyz", timeout=10).ok, 30, "ready again")
    keyed = resent(stack, key, maybe)
    time.sleep(3)  # load goes on after the stall too
    load.stop()
    long_jobs = {j for j in every_record(stack.admin) - before
                 if stack.redis.hget(f"iq:job:{j}", "model") == "long"}
    tally = counted(stack, log, load, frozen - 1, back, before | {keyed} | long_jobs)
    assert tally["slowest_submit_s"] < DEADLINE_S + SLACK_S
    assert tally["lost"] == tally["failed"] == tally["never_ran"] == tally["gave_up"] == 0
    assert tally["unknown_records"] == 0  # no submit made a job its client was not told of
    if seconds < Settings.visibility_timeout_s:
        assert tally["twice"] == 0
    return tally


def waiting(api: str) -> int:
    text = requests.get(f"{api}/metrics", timeout=10).text
    return int(float(re.search(r"^iq_waiting_requests (\S+)$", text, re.M).group(1)))


def test_redis_frozen_ten_seconds_under_load(stalled):
    """Nothing runs twice: leases outlive a 10 s stall. A request waiting on a job that runs
    through the start of the freeze keeps waiting, holding no Redis call, and gets the job
    once it finishes."""
    stack, _log = stalled
    waited: dict = {}

    def wait_on_a_long_job() -> None:
        job_id = stack.submit("long", ["waited"])["id"]
        threading.Thread(target=lambda: waited.update(stack.job(job_id, wait=25)),
                         daemon=True).start()
        wait_until(lambda: stack.redis.hget(f"iq:job:{job_id}", "status") == "running"
                   and waiting(stack.api) == 1, 30, "the long job running, a request on it")

    freeze(stalled, 10, "frozen10", first=wait_on_a_long_job)
    wait_until(lambda: waited, 30, "the waiting request's answer")
    assert waited["status"] == "succeeded"


def test_redis_frozen_past_the_visibility_timeout_under_load(stalled):
    """45 s: every lease the worker held lapses while Redis is frozen, so what it held (at
    most two batches' worth) may run a second time; nothing else does, and nothing is lost."""
    tally = freeze(stalled, 45, "frozen45")
    assert tally["twice"] <= HELD


def test_redis_killed_under_load_and_restarted(stalled, tmp_path_factory):
    """SIGKILL: the append-only file holds every accepted job (written before each answer)."""
    stack, log = stalled
    before = every_record(stack.admin)
    load = Load(stack.api, "slow", "killed").start()
    wait_until(lambda: len(load.accepted) >= 40, 60, "load under way")
    stack.redis_svc.stop(signal.SIGKILL)
    killed = time.monotonic()
    probes = probe_while_away(stack, 8, list(load.accepted.values())[0])
    assert all(ready == 503 and took < DEADLINE_S + SLACK_S and health == 200
               for ready, took, health, _ in probes), probes
    stack.redis_svc = start_redis(stack.workdir, appendonly=True, like=stack.redis_svc)
    back = time.monotonic()
    time.sleep(3)
    load.stop()
    tally = counted(stack, log, load, killed, back, before)
    assert tally["slowest_submit_s"] < DEADLINE_S + SLACK_S
    # The fetch moves a message onto the worker's in-flight record in the script that takes it
    # off its queue: a Redis killed as it served a fetch leaves the message on the record,
    # where the worker finds it again (or the reconciler queues it again), so nothing is lost.
    assert tally["lost"] == tally["never_ran"] == 0
    assert tally["failed"] == tally["gave_up"] == 0
    assert tally["twice"] == tally["unknown_records"] == 0


def test_a_submit_redis_left_unanswered_is_resent_at_once_and_makes_one_job(stalled, caplog):
    """Redis frozen: each try of a submit is answered 503 within the deadline with
    Retry-After 0 (it waited the deadline already) and names the job it may have recorded; the
    client resends at once, with the same Idempotency-Key, and once Redis resumes gets one of
    the job one of them recorded: one record, one run."""
    stack, log = stalled
    before = every_record(stack.admin)
    answers: list[requests.Response] = []
    session = requests.Session()
    session.hooks["response"].append(lambda r, *args, **kwargs: answers.append(r))
    got: dict = {}
    submitting = threading.Thread(target=lambda: got.update(job=Client(
        stack.api, session=session).submit("slow", ["resent at once"])), daemon=True)
    pid = stack.redis_svc.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        submitting.start()
        wait_until(lambda: len(answers) >= 2, 3 * (DEADLINE_S + SLACK_S), "two tries answered")
    finally:
        os.kill(pid, signal.SIGCONT)
    submitting.join(60)
    *refused, accepted = answers
    assert [r.status_code for r in refused] == [503] * len(refused), [r.text for r in refused]
    assert all(r.headers["Retry-After"] == "0" for r in refused)
    assert accepted.status_code == 202 and got["job"].id == accepted.json()["id"]
    keys = {r.request.headers["Idempotency-Key"] for r in answers}
    assert len(keys) == 1  # each resend with the first one's key
    # Each try named a job of its own, and the scripts the frozen Redis ran once it resumed
    # made one of them; every other try found the key claimed: one job, the one answered.
    assert len({r.json()["error"]["job_id"] for r in refused}) == len(refused)
    assert every_record(stack.admin) - before == {got["job"].id}
    assert stack.finished(got["job"].id)["status"] == "succeeded"
    assert runs(log)["resent at once"] == 1
    delays = [m for m in caplog.messages if "retrying in" in m]
    assert len(delays) == len(refused) and all(m.endswith("retrying in 0.0s") for m in delays)
