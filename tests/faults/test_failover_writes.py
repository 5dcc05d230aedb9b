"""A replicated Redis as make run starts one (scripts/redis_nodes.py, as scripts/run_redis.py
plans it: min-replicas-to-write 1 on every node) refuses writes on a primary without a replica
in sync, and the application takes that refusal for "Redis unavailable, try again"
(`is_transient`), in every form a write can take: a command, a script, a pipeline.

After `SENTINEL FAILOVER` the old primary stays a primary for 10-13 s (until the sentinels
demote it), and clients still connected to it keep writing there; what it took then, the
failover discards when it turns replica. With the setting it refuses those writes from the
moment its replica leaves it for the promoted one. Counted: the writes the old primary
acknowledged that the new one lacks (without the setting, every write of those seconds).
"""
from __future__ import annotations

import time

import pytest
import redis

from scripts.redis_nodes import MASTER, start_group, start_redis
from scripts.stack import wait_until
from tasks.redis_client import is_transient

pytestmark = pytest.mark.slow

WRITE = "return redis.call('SET', KEYS[1], ARGV[1])"


def test_a_primary_without_a_replica_in_sync_refuses_writes_as_a_transient_error(tmp_path):
    node = start_redis(tmp_path, min_replicas_to_write=1)  # a primary whose replica is gone
    try:
        client = redis.Redis.from_url(node.extra["admin_url"], decode_responses=True)
        refusals = []
        for write in (lambda: client.set("k", "v"), lambda: client.eval(WRITE, 1, "k", "v"),
                      lambda: client.pipeline().set("k", "v").execute_command("WAIT", 1, 10)
                      .execute()):
            with pytest.raises(redis.ResponseError) as refused:
                write()
            refusals.append(refused.value)
        assert all("NOREPLICAS" in str(r) and is_transient(r) for r in refusals), refusals
        assert client.get("k") is None and client.eval("return 1", 0) == 1  # reads go on
        assert not is_transient(redis.ResponseError("WRONGTYPE Operation against a key"))
    finally:
        node.stop()


def test_the_old_primary_refuses_writes_once_its_replica_is_promoted(tmp_path):
    group = start_group(tmp_path, replicas=1)
    try:
        old = redis.Redis.from_url(group.primary.extra["admin_url"], decode_responses=True,
                                   socket_timeout=3, retry=None)
        sentinel = redis.Redis.from_url(group.sentinels[0].extra["admin_url"])
        sentinel.execute_command("SENTINEL", "FAILOVER", MASTER)
        asked = time.monotonic()
        acked, refused, seq = [], [], 0
        # A client that stays connected to the old primary, as the application's do, writing
        # until the sentinels demote it (READONLY, or its connections closed).
        while time.monotonic() - asked < 60:
            seq += 1
            try:
                old.set(f"k{seq}", seq)
                acked.append(f"k{seq}")
            except (redis.exceptions.ReadOnlyError, redis.ConnectionError):
                break
            except redis.ResponseError as exc:
                refused.append(exc)
            time.sleep(0.01)
        demoted = time.monotonic() - asked
        wait_until(lambda: group.primary_port() != group.primary.extra["port"], 30, "promotion")
        new = redis.Redis.from_url(group.follow().extra["admin_url"], decode_responses=True)
        wait_until(lambda: new.info("replication")["connected_slaves"] == 1, 60,
                   "the old primary a replica of the new one")
        with new.pipeline(transaction=False) as pipe:
            for key in acked:
                pipe.exists(key)
            kept = pipe.execute()
        discarded = [key for key, there in zip(acked, kept) if not there]
        print(f"old primary demoted {demoted:.1f}s after the failover was asked; "
              f"{len(acked)} writes acknowledged there, {len(discarded)} of them discarded, "
              f"{len(refused)} refused")
        assert refused and all("NOREPLICAS" in str(r) and is_transient(r) for r in refused)
        # The replica leaves in the instant of its promotion: a write the old primary took in
        # that same instant, before it read its replica's goodbye, is the most that can go.
        assert len(discarded) <= 1, discarded
    finally:
        group.stop()
