"""A replicated Redis as make run starts one (scripts/redis_nodes.py, as scripts/run_redis.py
plans it: min-replicas-to-write 1 on every node) refuses writes on a primary without a replica
in sync, and the application takes that refusal for "Redis unavailable, try again"
(`is_transient`), in every form a write can take: a command, a script, a pipeline.

After `SENTINEL FAILOVER` the old primary stays a primary until it is demoted, and clients
still connected to it keep writing there; what it took then, the failover discards when it
turns replica. With the setting it refuses those writes from the moment its replica leaves it
for the promoted one. Counted: the writes the old primary acknowledged that the new one lacks
(without the setting, every write of those seconds).

Sentinel alone demotes the old primary about 10 s after the promotion (it waits 8 s after the
node first claims the primary's role, then for its next INFO, every 10 s); until then the
promoted node has no replica and, with the setting, takes no write. The sentinels'
client-reconfig-script (scripts/redis-demote.sh) demotes it at the promotion: the promoted
node has a replica in sync within IN_SYNC_S, and no write a replica confirmed is lost.
"""
from __future__ import annotations

import threading
import time

import pytest
import redis

from scripts.redis_nodes import MASTER, start_group, start_redis
from scripts.stack import wait_until
from tasks.redis_client import is_transient

pytestmark = pytest.mark.slow

WRITE = "return redis.call('SET', KEYS[1], ARGV[1])"
# From the promotion to a replica in sync on the promoted node (what min-replicas-to-write
# counts): Sentinel alone takes 10 s and never less than 8; the demotion at the promotion, a
# resync (a full one: the sentinels' hellos moved the old primary's offset on), well under 1 s
# on a quiet machine.
IN_SYNC_S = 5.0


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


class ConfirmedWriter(threading.Thread):
    """A client of the primary the sentinels name (as the application's are), writing one key
    after another, each followed by WAIT for one replica, as a submit is: a write the replica
    confirmed is `confirmed`, one refused or unanswered is only counted."""

    def __init__(self, group, name: str) -> None:
        super().__init__(daemon=True)
        sentinels = [("127.0.0.1", s.extra["port"]) for s in group.sentinels]
        password = group.primary.extra["password"]
        self.client = redis.sentinel.Sentinel(
            sentinels, sentinel_kwargs={"password": password, "socket_timeout": 2},
            password=password, socket_timeout=2).master_for(MASTER)
        self.name, self.confirmed, self.failed = name, [], 0
        self.halt = threading.Event()

    def run(self) -> None:
        seq = 0
        while not self.halt.is_set():
            seq += 1
            key = f"{self.name}:{seq}"
            try:
                with self.client.pipeline(transaction=False) as pipe:
                    replicas = pipe.set(key, seq).execute_command("WAIT", 1, 1000).execute()[1]
            except redis.RedisError:
                self.failed += 1
                self.halt.wait(0.05)  # a refused write is retried, not in a hot loop
                continue
            if replicas >= 1:
                self.confirmed.append(key)


def _role(client: redis.Redis) -> str:
    return client.info("replication")["role"]


def _in_sync(primary: redis.Redis) -> bool:
    """A replica in sync as min-replicas-to-write counts them: the primary takes writes."""
    return primary.info("replication").get("min_slaves_good_slaves", 0) >= 1


def _confirmed(writers: list[ConfirmedWriter]) -> int:
    return sum(len(w.confirmed) for w in writers)


def _lost(primary: redis.Redis, writers: list[ConfirmedWriter]) -> tuple[list[str], list[str]]:
    """Once the writers have had writes confirmed by the primary of now: every key confirmed
    and those of them that it lacks."""
    before = _confirmed(writers)
    wait_until(lambda: _confirmed(writers) >= before + 200, 60, "writes confirmed after it")
    for writer in writers:
        writer.halt.set()
        writer.join(10)
    keys = [key for w in writers for key in w.confirmed]
    with primary.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.exists(key)
        kept = pipe.execute()
    return keys, [key for key, there in zip(keys, kept) if not there]


@pytest.fixture
def loaded(tmp_path):
    """A group as make run starts it, four writers confirming writes on it."""
    group = start_group(tmp_path, replicas=1)
    writers = [ConfirmedWriter(group, f"w{i}") for i in range(4)]
    for writer in writers:
        writer.start()
    try:
        wait_until(lambda: _confirmed(writers) >= 200, 60, "writes confirmed under load")
        yield group, writers
    finally:
        for writer in writers:
            writer.halt.set()
        group.stop()


def test_the_promoted_primary_has_a_replica_in_sync_at_once_and_loses_no_confirmed_write(
        loaded):
    group, writers = loaded
    promoted = redis.Redis.from_url(group.replicas[0].extra["admin_url"],
                                    decode_responses=True, socket_timeout=5)
    redis.Redis.from_url(group.sentinels[0].extra["admin_url"]).execute_command(
        "SENTINEL", "FAILOVER", MASTER)
    wait_until(lambda: _role(promoted) == "master", 30, "the replica promoted", interval=0.02)
    at = time.monotonic()
    wait_until(lambda: _in_sync(promoted), 60, "a replica in sync with the promoted node",
               interval=0.02)
    in_sync = time.monotonic() - at
    keys, lost = _lost(promoted, writers)
    print(f"a replica in sync with the promoted node {in_sync:.2f} s after the promotion; "
          f"{len(keys)} writes confirmed, {len(lost)} of them lost; "
          f"{sum(w.failed for w in writers)} refused or unanswered")
    assert lost == [], lost
    assert in_sync <= IN_SYNC_S, f"no replica in sync for {in_sync:.1f} s"


def test_a_killed_primary_started_again_after_the_failover_is_a_replica_at_once(loaded):
    """The primary SIGKILLed, the replica promoted, then the old primary started again as
    make run's supervisor starts it: it asks the sentinels its role and comes back as the
    promoted node's replica (scripts/redis-server.sh), not as a primary that Sentinel demotes
    about 10 s later."""
    group, writers = loaded
    old = group.primary
    old.proc.kill()  # redis-server.sh execs redis-server: this is it
    old.proc.wait(10)
    wait_until(lambda: group.primary_port() not in (None, old.extra["port"]), 60,
               "the sentinels to promote the replica")
    promoted = redis.Redis.from_url(group.follow().extra["admin_url"], decode_responses=True,
                                    socket_timeout=5)
    at = time.monotonic()
    again = group.restart(old)
    wait_until(lambda: _in_sync(promoted), 60, "the old primary in sync as a replica",
               interval=0.02)
    in_sync = time.monotonic() - at
    keys, lost = _lost(promoted, writers)
    print(f"the old primary, started again, a replica in sync {in_sync:.2f} s after its "
          f"start; {len(keys)} writes confirmed, {len(lost)} of them lost")
    assert _role(redis.Redis.from_url(again.extra["admin_url"], decode_responses=True)) \
        == "slave"
    assert lost == [], lost
    assert in_sync <= IN_SYNC_S, f"no replica in sync for {in_sync:.1f} s"
