"""Redis Sentinel on the default settings: a primary (append-only file), one replica and three
sentinels on loopback (scripts/redis_nodes.py), every process pointed at the sentinels: the
API, its waiter, the worker (kombu's Sentinel transport, Celery's Sentinel backend), the
webhook deliverer and Flower. A submit answers 202 only once the replica holds the job.

Under load from the project's Python client the primary is SIGKILLed: the sentinels promote
the replica and every process follows, without a restart. Counted per job id: none lost,
every job accepted before the kill final within 60 s of the promotion, only jobs of a batch
that was running may run twice, and every submit answered within the deadline (503 while
there is no primary, or no replica to hold the job). Then the old primary comes back as a
replica, and submits are accepted again.
"""
from __future__ import annotations

import collections
import os
import signal
import time
import uuid

import pytest
import redis
import requests

from config import Settings
from scripts.stack import launch, start_flower, start_webhooks, wait_until
from tasks.jobstate import JobRecord
from tests.support.load import Load, every_record, job_statuses, runs
from tests.support.receivers import Receiver

pytestmark = pytest.mark.slow

DEADLINE_S = Settings.redis_deadline_s
SLACK_S = 1.5
FLOWER = ("ops", "failover-flower-password")


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("failover")
    log = workdir / "runs.log"
    models = {"slow": {"kind": "synthetic", "base_ms": 100, "per_item_ms": 0,
                       "max_batch_size": 8, "max_inputs": 1, "runs_log": str(log)}}
    stack = launch(workdir, models, {"w": ["slow"]}, defaults=True, replicated=True,
                   env_extra={"IQ_WEBHOOK_ALLOW": "127.0.0.1"})
    stack.workers["hooks"] = start_webhooks("hooks", stack.env, workdir)
    flower = start_flower(stack.env, workdir, ":".join(FLOWER))
    yield stack, log, flower.extra["url"]
    flower.stop()
    stack.stop()


def post(api: str, key: str, text: str) -> requests.Response:
    return requests.post(f"{api}/v1/jobs", json={"model": "slow", "inputs": [text]},
                         headers={"Idempotency-Key": key}, timeout=30)


def in_sync(node) -> bool:
    links = redis.Redis.from_url(node.extra["admin_url"], decode_responses=True,
                                 socket_timeout=2).info("replication")
    return links["role"] == "slave" and links.get("master_link_status") == "up"


def test_a_job_no_replica_confirms_is_refused_and_the_resend_returns_it(replicated):
    """The replica stalls: the submit answers 503 within the deadline, saying the job is
    recorded on the primary; once the replica is back, the resend with the same key gets a
    202 for that same job, which runs once."""
    stack, log, _flower = replicated
    replica = stack.group.replicas[0]
    key = str(uuid.uuid4())
    os.kill(replica.proc.pid, signal.SIGSTOP)
    try:
        asked = time.monotonic()
        refused = post(stack.api, key, "unconfirmed")
        took = time.monotonic() - asked
    finally:
        os.kill(replica.proc.pid, signal.SIGCONT)
    assert refused.status_code == 503 and int(refused.headers["Retry-After"]) > 0, refused.text
    assert took < DEADLINE_S + SLACK_S
    error = refused.json()["error"]
    assert "recorded on the primary" in error["message"]
    wait_until(lambda: in_sync(replica), 30, "the replica back in sync")
    again = post(stack.api, key, "unconfirmed")
    assert again.status_code == 202 and again.json()["id"] == error["job_id"], again.text
    assert stack.finished(error["job_id"])["status"] == "succeeded"
    assert runs(log)["unconfirmed"] == 1


def test_the_application_may_only_ask_the_sentinels_where_the_primary_is(replicated):
    stack, _log, _flower = replicated
    sentinel = stack.group.sentinels[0]
    app = redis.Redis(port=sentinel.extra["port"], username=stack.env["IQ_REDIS_SENTINEL_USER"],
                      password=stack.env["IQ_REDIS_SENTINEL_PASSWORD"], decode_responses=True)
    assert app.sentinel_get_master_addr_by_name("mymaster")[1] == stack.redis_svc.extra["port"]
    for command in (("SENTINEL", "FAILOVER", "mymaster"),
                    ("SENTINEL", "SET", "mymaster", "quorum", "1"),
                    ("SENTINEL", "REMOVE", "mymaster"), ("ACL", "LIST")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            app.execute_command(*command)


def running(client: redis.Redis) -> set[str]:
    return {job_id for job_id, status in job_statuses(client, sorted(every_record(client)))
            .items() if status == "running"}


def test_the_primary_killed_under_load(replicated, tmp_path_factory):
    stack, log, flower = replicated
    group = stack.group
    before = every_record(stack.admin)
    load = Load(stack.api, "slow", "failover").start()
    wait_until(lambda: len(load.accepted) >= 60, 60, "load under way")
    # The worker fetches through its in-flight record (workers/broker/fetch.py) on kombu's
    # Sentinel transport too: it is registered among the fetchers.
    assert stack.admin.hlen("iq:fetchers") >= 1
    old = group.primary
    held = running(stack.admin)  # batches running now: the only jobs that may run twice
    accepted_before = set(load.accepted.values())
    os.kill(old.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    # A batch may start between the read above and the kill. The replica holds now what the
    # promoted node will start from (nothing writes to it before the promotion, seconds
    # away): its running jobs are those running at the kill as the survivor knows them. Read
    # after the promotion instead, a batch finished there meanwhile would be missing.
    held |= running(redis.Redis.from_url(group.replicas[0].extra["admin_url"],
                                         decode_responses=True, socket_timeout=5))
    wait_until(lambda: group.primary_port() not in (None, old.extra["port"]), 60,
               "the sentinels to promote the replica")
    promoted, promoted_wall = time.monotonic(), time.time()
    stack.redis_svc = group.follow()
    held |= running(stack.admin)  # as the promoted replica had them
    print(f"promoted {promoted - killed:.1f}s after the kill")

    # No replica now: submits are refused (503) within the deadline, never accepted unsafely.
    time.sleep(3)
    # Started again as make run's supervisor starts it: it asks the sentinels for its role.
    restarted = group.restart(old)
    wait_until(lambda: in_sync(restarted), 60, "the old primary back as a replica")
    rejoined = time.monotonic()
    print(f"old primary a replica again {rejoined - promoted:.1f}s after the promotion")
    wait_until(lambda: any(a.status == 202 for a in load.answers if a.at > rejoined), 30,
               "submits accepted again")
    load.stop()

    ids = list(load.accepted.values())
    try:
        wait_until(lambda: set(job_statuses(stack.redis, ids).values()) == {"succeeded"}, 60,
                   f"all {len(ids)} accepted jobs succeeded")
    except TimeoutError:
        pass  # counted below
    # The fetch takes a message off its queue and onto the worker's in-flight record in one
    # script: one the old primary served as it was killed is on the promoted replica's record
    # (or queued again by the reconciler), never lost.
    lost = {j for j, s in job_statuses(stack.redis, ids).items() if s != "succeeded"}
    finished = {job_id: JobRecord.from_fields(job_id, stack.redis.hgetall(
                    f"iq:job:{job_id}")).finished_at.timestamp()
                for job_id in accepted_before - lost}
    ran = runs(log)
    twice = {load.accepted[text] for text in load.accepted if ran[text] > 1}
    switch = [a for a in load.answers if killed <= a.at <= rejoined]
    tally = {"accepted": len(ids), "accepted_before_kill": len(accepted_before),
             "twice": len(twice), "held_at_kill": len(held),
             "unknown_records": len(every_record(stack.admin) - set(ids) - before),
             "gave_up": len(load.gave_up), "lost": len(lost),
             "last_final_after_promotion_s": round(max(finished.values()) - promoted_wall, 1),
             "slowest_submit_s": round(load.slowest(), 2),
             "answers_during_switch": dict(collections.Counter(a.status for a in switch))}
    print(f"failover: {tally}")
    assert tally["lost"] == tally["gave_up"] == tally["unknown_records"] == 0, lost
    assert all(ran[text] >= 1 for text in load.accepted), "an accepted job never ran"
    assert twice <= held, f"{len(twice - held)} job(s) ran twice outside a running batch"
    assert tally["last_final_after_promotion_s"] <= 60
    assert {a.status for a in switch} <= {202, 503} and 503 in {a.status for a in switch}
    assert tally["slowest_submit_s"] < DEADLINE_S + SLACK_S

    # Every other process follows too: the waiter's pub/sub, the webhook deliverer, Flower.
    held_answer = requests.post(f"{stack.api}/v1/jobs", json={"model": "slow", "inputs": ["w"]},
                                headers={"Prefer": "wait=20"}, timeout=30)
    assert held_answer.status_code == 201, held_answer.text
    receiver = Receiver()
    try:
        hooked = requests.post(f"{stack.api}/v1/jobs", json={
            "model": "slow", "inputs": ["hooked"], "webhook": {"url": receiver.url}}, timeout=30)
        assert hooked.status_code == 202, hooked.text
        wait_until(lambda: receiver.calls, 60, "the webhook after the failover")
    finally:
        receiver.close()
    queues = requests.get(f"{flower}/api/queues/length", auth=FLOWER, timeout=10)
    assert queues.ok and "slow" in {q["name"] for q in queues.json()["active_queues"]}
    workers = requests.get(f"{flower}/api/workers?refresh=1", auth=FLOWER, timeout=30).json()
    assert any(name.startswith("w@") for name in workers)
