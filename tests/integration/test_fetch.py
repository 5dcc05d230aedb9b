"""The worker's fetch, in-flight record and recovery (workers/broker/) on a real Redis, through
kombu as a worker installs it: a message is on its queue or on a worker's in-flight record at
every instant, a worker's lease is one key on Redis's clock, and what a stopped worker held
comes back."""
from __future__ import annotations

import json
import time
import uuid
from time import monotonic

import kombu
import orjson
import pytest
import redis

from tasks.jobstate import JobState, new_job
from tasks.keys import PENDING_KEY, delayed_key, wake_key
from tasks.messages import QueuedMessage
from workers.broker import Broker, InFlight
from workers.broker.lua import FETCHERS_KEY
from workers.broker.broker import Broker
from workers.broker.transport import REDIS_ALIAS  # the worker's transport

QUEUE = "iq-fetch-test"


@pytest.fixture
def admin(clean_admin):
    return clean_admin


@pytest.fixture
def redis_url(redis_server, admin):
    return redis_server.extra["url"]


@pytest.fixture
def server(redis_url):
    return redis.Redis.from_url(redis_url, decode_responses=True)


@pytest.fixture
def broker():
    broker = Broker(lease_s=30, heartbeat_s=2).install(node="t@test")
    yield broker
    broker.uninstall()


def publish(conn: kombu.Connection, *payloads: dict, queue: str = QUEUE) -> None:
    q = kombu.Queue(queue)
    for payload in payloads:
        conn.Producer().publish(payload, routing_key=q.name, declare=[q], serializer="json")


def consumer(conn: kombu.Connection, got: list, prefetch: int = 10) -> kombu.Consumer:
    c = conn.Consumer(kombu.Queue(QUEUE), callbacks=[lambda _body, m: got.append(m)],
                      accept=["json"])
    c.qos(prefetch_count=prefetch)
    return c


def calls(server: redis.Redis, command: str) -> int:
    return server.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)


def test_one_fetch_moves_a_burst_onto_the_in_flight_record_oldest_first(redis_url, server,
                                                                        broker):
    with kombu.Connection(redis_url, transport=REDIS_ALIAS) as conn:
        publish(conn, *({"n": n} for n in range(5)))
        got: list = []
        with consumer(conn, got, prefetch=3):
            before = {c: calls(server, c) for c in ("brpop", "rpop", "ltrim", "hset")}
            conn.drain_events(timeout=5)
            # One move took three (the prefetch room), in the order BRPOP would: one LTRIM
            # off the queue, one HSET onto the record, no pop.
            assert [m.payload["n"] for m in got] == [0, 1, 2]
            assert {c: calls(server, c) - n for c, n in before.items()} == \
                {"brpop": 0, "rpop": 0, "ltrim": 1, "hset": 1}
            assert server.llen(QUEUE) == 2
            for m in got:  # each on the record, with its list, as it was on the queue
                entry = server.hget(broker.inflight_key, m.delivery_tag)
                list_key, message = entry.split("\n", 1)
                assert list_key == QUEUE and json.loads(message) == m._raw
            assert server.hget(FETCHERS_KEY, broker.incarnation) == "t@test"
            assert 25_000 < server.pttl(broker.alive_key) <= 30_000
            got[0].ack()
            got[1].requeue()  # back at the head of its queue, off the record
            assert server.hlen(broker.inflight_key) == 1
            assert json.loads(server.lindex(QUEUE, -1)) == got[1]._raw


def test_a_message_that_only_looks_like_one_is_put_aside_and_the_others_delivered(
        redis_url, server, broker):
    """The fetch finds a message's tag by its text, without decoding it inside Redis: one that
    names a tag yet is not JSON, or names it outside its properties, is put aside by the worker
    (off the in-flight record, onto iq:malformed: never delivered, never fetched again), and
    what kombu wrote beside it is delivered."""
    not_json = '{"properties": {"delivery_tag": "bad-1"}, oops}'
    elsewhere = '{"body": "", "headers": {"delivery_tag": "bad-2"}, "properties": {}}'
    with kombu.Connection(redis_url, transport=REDIS_ALIAS) as conn:
        server.lpush(QUEUE, not_json, elsewhere)
        publish(conn, {"n": 1})
        got: list = []
        with consumer(conn, got):
            conn.drain_events(timeout=5)
            assert [m.payload["n"] for m in got] == [1]
            assert server.lrange("iq:malformed", 0, -1) == [not_json, elsewhere]
            assert server.hkeys(broker.inflight_key) == [got[0].delivery_tag]
            assert server.llen(QUEUE) == 0


def test_a_fetchs_messages_reach_a_consumer_that_takes_them_together_in_one_call(
        redis_url, server, broker):
    """A consumer whose message handler takes several at once (`many`: the worker's Celery
    consumer, workers/broker/intake.py) is handed a fetch's messages in one call, in the order
    fetched, each recorded in kombu's books and settled as any other; a message kombu could
    not read (a compression it does not know) still goes to the consumer's own callback, one
    at a time, where kombu reports it."""
    broken = {"body": "eA==", "content-encoding": "binary", "content-type": "application/json",
              "headers": {"compression": "application/x-unknown"},
              "properties": {"body_encoding": "base64", "delivery_tag": "broken",
                             "delivery_info": {"exchange": "", "routing_key": QUEUE},
                             "priority": 0}}
    with kombu.Connection(redis_url, transport=REDIS_ALIAS) as conn:
        publish(conn, *({"n": n} for n in range(3)))
        server.lpush(QUEUE, json.dumps(broken))  # fetched last
        publish(conn, {"n": 3})
        calls_of_many: list[list] = []
        one_at_a_time: list = []
        decode_errors: list = []

        def on_message(message):
            one_at_a_time.append(message)

        on_message.many = calls_of_many.append
        c = conn.Consumer(kombu.Queue(QUEUE), on_message=on_message, accept=["json"],
                          on_decode_error=lambda m, exc: decode_errors.append(m))
        c.qos(prefetch_count=10)
        with c:
            conn.drain_events(timeout=5)
            assert len(calls_of_many) == 1, "one call for the fetch's messages"
            [messages] = calls_of_many
            assert [m.payload["n"] for m in messages] == [0, 1, 2, 3]
            assert one_at_a_time == []
            assert [m.delivery_tag for m in decode_errors] == ["broken"]
            delivered = conn.default_channel.qos._delivered
            assert {m.delivery_tag for m in messages} <= set(delivered)
            assert server.hlen(broker.inflight_key) == 5
            for m in messages:
                m.ack()
            assert server.hkeys(broker.inflight_key) == ["broken"]


def test_the_fetch_the_lease_and_the_settlements_work_while_redis_is_full(redis_url, server,
                                                                          admin, broker):
    with kombu.Connection(redis_url, transport=REDIS_ALIAS) as conn:
        publish(conn, {"n": 7}, {"n": 8})
        channel = conn.channel()
        InFlight(server, broker).beat()
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # every denyoom write refused from now on
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            server.set("probe", "x")
        queue = kombu.Queue(QUEUE)
        first, second = (queue(channel).get(no_ack=False) for _ in range(2))
        # Taken off the queue onto the record although Redis refuses writes: nothing lost.
        assert (first.payload, second.payload) == ({"n": 7}, {"n": 8})
        assert server.llen(QUEUE) == 0 and server.hlen(broker.inflight_key) == 2
        server.pexpire(broker.alive_key, 5_000)
        assert InFlight(server, broker).beat() is True  # renewed, full or not
        assert server.pttl(broker.alive_key) > 25_000
        first.requeue()
        second.ack()
        assert server.llen(QUEUE) == 1 and server.hlen(broker.inflight_key) == 0
        channel.close()


def test_a_reply_lost_with_its_connection_is_put_back_by_the_next_channel(redis_url, server,
                                                                          broker):
    with kombu.Connection(redis_url, transport=REDIS_ALIAS) as conn:
        publish(conn, {"n": 1}, {"n": 2})
        channel = conn.channel()
        lost: list = []
        with channel.Consumer(kombu.Queue(QUEUE), callbacks=[lambda _b, m: lost.append(m)]):
            conn.transport.cycle._register_BRPOP(channel)  # the fetch is sent...
            deadline = monotonic() + 5
            while server.llen(QUEUE) and monotonic() < deadline:
                time.sleep(0.01)
            channel.client.connection.disconnect()  # ...and its reply never read
            assert not lost and server.llen(QUEUE) == 0
            assert server.hlen(broker.inflight_key) == 2  # not lost: on the record
    with kombu.Connection(redis_url, transport=REDIS_ALIAS) as conn:
        got: list = []
        with consumer(conn, got):  # a new channel: what nobody received goes back
            assert server.hlen(broker.inflight_key) == 0
            conn.drain_events(timeout=5)
        assert sorted(m.payload["n"] for m in got) == [1, 2]


def test_closing_a_channel_leaves_what_the_dispatcher_holds(redis_url, server, broker):
    with kombu.Connection(redis_url, transport=REDIS_ALIAS) as conn:
        publish(conn, {"n": 0}, {"n": 1})
        channel = conn.channel()
        held, free = (kombu.Queue(QUEUE)(channel).get(no_ack=False) for _ in range(2))
        broker.held[held.delivery_tag] = held
        channel.close()
        # The free one went back to the queue; the held one is still this worker's.
        assert server.llen(QUEUE) == 1
        assert server.hexists(broker.inflight_key, held.delivery_tag)
        assert not server.hexists(broker.inflight_key, free.delivery_tag)


def taken(server: redis.Redis, state: Broker, count: int) -> list[str]:
    """`count` messages published now and taken onto `state`'s record; their tags."""
    for n in range(count):
        server.lpush(QUEUE, json.dumps({"properties": {"delivery_tag": str(uuid.uuid4())},
                                        "n": n}))
    inflight = InFlight(server, state)
    if server.pttl(state.alive_key) < 0:
        inflight.beat()
    got = inflight.take([QUEUE], count)
    return [json.loads(m)["properties"]["delivery_tag"] for _list, m in got]


def test_a_stopped_workers_messages_come_back_and_a_live_ones_stay(server, broker):
    dead, live = Broker(), Broker()
    dead.name("dead@test")
    live.name("live@test")
    taken(server, dead, 2)
    taken(server, live, 1)
    server.delete(dead.alive_key)  # it stopped beating a lease ago
    reaper = InFlight(server, broker)
    reaper.beat()
    # A worker that has not held its own lease for a whole lease takes no one's back: after
    # Redis was away that long, every lease is gone, and the live workers must beat first.
    assert reaper.reap() == 0 and server.hlen(dead.inflight_key) == 2
    broker.lease_since = monotonic() - 31
    assert reaper.reap() == 2
    assert server.llen(QUEUE) == 2 and not server.exists(dead.inflight_key)
    assert server.hget(FETCHERS_KEY, dead.incarnation) is None
    assert server.hlen(live.inflight_key) == 1  # its lease lives: its messages stay


def test_an_earlier_incarnation_of_a_node_is_taken_back_once_it_missed_its_beats(server,
                                                                                broker):
    before = Broker(lease_s=30, heartbeat_s=2)
    before.name(broker.node)  # this worker, before it was killed and started again
    taken(server, before, 1)
    reaper = InFlight(server, broker)
    reaper.beat()  # young: it takes no other node's lapsed lease yet
    assert reaper.reap() == 0  # its lease was renewed just now: it may be a twin
    server.pexpire(before.alive_key, 23_000)  # no beat for 7 s (three beats missed)
    assert reaper.reap() == 1 and server.llen(QUEUE) == 1


def submit(state: JobState, marker: str) -> str:
    job = new_job(str(uuid.uuid4()), model="m", trace_id="t", inputs=1, priority="normal")
    payload = orjson.dumps({"properties": {"delivery_tag": str(uuid.uuid4())}, "m": marker})
    state.submit(job, QueuedMessage(QUEUE, payload), depth_lists=[QUEUE], max_depth=100,
                 ttl_s=60)
    return job.id


def test_the_reconciler_queues_again_only_a_job_whose_message_is_nowhere(server, broker):
    jobs = JobState(server)
    lost, held, waiting = (submit(jobs, m) for m in ("lost", "held", "waiting"))
    worker = InFlight(server, Broker())
    worker.beat()
    worker.take([QUEUE], 2)  # the two oldest, on a worker's record
    message = server.hget(f"iq:job:{lost}", "message")
    # One dropped from it, as a Redis failover that lost the write would leave it: nowhere.
    worker.ack([json.loads(message)["properties"]["delivery_tag"]])
    assert server.llen(QUEUE) == 1 and server.hlen(worker.state.inflight_key) == 1
    # Not final for longer than a lease (30 s): the reconciler looks at them.
    server.zadd(PENDING_KEY, {lost: 1, held: 1, waiting: 1})
    assert InFlight(server, broker).reconcile() == [lost]
    assert server.llen(QUEUE) == 2 and server.lindex(QUEUE, -1) == message
    assert InFlight(server, broker).reconcile() == []  # one pass at a time, now and then
    assert server.zscore(PENDING_KEY, lost) > 1  # looked at again a lease later


def test_the_reconciler_scores_a_job_it_checked_by_whole_seconds_rounded_up(server, broker):
    """A job checked and left (its message is on its queue) is looked at again a lease later:
    scored, like a submit's, by Redis's clock in whole seconds rounded up, so the pending
    set keeps the integer scores of its compact form and the next look is never early."""
    jobs = JobState(server)
    ids = [submit(jobs, f"waiting-{n}") for n in range(3)]
    server.zadd(PENDING_KEY, dict.fromkeys(ids, 1))  # not final for longer than a lease
    before = server.time()
    assert InFlight(server, broker).reconcile() == []  # each is on its queue
    after = server.time()
    scores = [server.zscore(PENDING_KEY, job_id) for job_id in ids]
    assert all(score == int(score) for score in scores), scores
    assert all(before[0] + before[1] / 1e6 <= score <= after[0] + 1 for score in scores)


def test_an_empty_queue_gets_one_wake_up_token_and_an_idle_channel_waits_on_it(redis_url,
                                                                               server, broker):
    jobs = JobState(server)
    submit(jobs, "a")
    submit(jobs, "b")  # the queue was not empty: no second token
    assert server.llen(wake_key(QUEUE)) == 1
    with kombu.Connection(redis_url, transport=REDIS_ALIAS) as conn:
        got: list = []
        with consumer(conn, got):
            conn.drain_events(timeout=2)
            assert sorted(m._raw["m"] for m in got) == ["a", "b"]
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.5)  # nothing waits: the fetch found nothing...
            # ...so the channel blocks on the queue's wake-up list (the stale token taken),
            # which the next submit feeds.
            assert conn.default_channel._iq_reply == "wake"
            assert server.llen(wake_key(QUEUE)) == 0
            submit(jobs, "c")
            conn.drain_events(timeout=2)
            assert [m._raw["m"] for m in got] == ["a", "b", "c"]


def test_a_delayed_message_is_fetched_once_due_by_redis_clock(redis_url, server, broker):
    broker.delayed_queues.add(QUEUE)
    now = float(server.time()[0])
    for marker, due in (("due", now - 1), ("later", now + 600)):
        body = json.dumps({"body": "", "properties": {"delivery_tag": marker,
                                                       "body_encoding": "base64"},
                           "headers": {}, "content-type": "application/json",
                           "content-encoding": "utf-8", "m": marker})
        server.zadd(delayed_key(QUEUE), {f"{QUEUE}\n{body}": due})
    with kombu.Connection(redis_url, transport=REDIS_ALIAS) as conn:
        message = kombu.Queue(QUEUE)(conn.channel()).get(no_ack=False)
        assert message.delivery_tag == "due"
        assert server.zcard(delayed_key(QUEUE)) == 1  # the later one waits


def test_the_event_loop_adds_the_fetch_socket_once_not_at_every_turn(redis_url, server,
                                                                     broker):
    """kombu's tick adds each socket to the event loop at every turn, which epoll refuses
    (held already); the worker's transport adds it only when the loop may not hold it
    (workers/broker/transport.py `_KeepRegistrations`): once, and again once removed."""
    from kombu.asynchronous import Hub

    hub = Hub()
    registered: list[int] = []
    real = hub.poller.register
    hub.poller.register = lambda fd, events: (registered.append(fd), real(fd, events))[1]
    jobs = JobState(server)
    with kombu.Connection(redis_url, transport=REDIS_ALIAS) as conn:
        got: list = []
        with consumer(conn, got):
            conn.transport.register_with_event_loop(conn.connection, hub)

            def turns_until(count: int) -> int:
                turns, end = 0, monotonic() + 10
                while len(got) < count and monotonic() < end:
                    hub.run_once()
                    turns += 1
                assert len(got) == count
                return turns

            turns = 0
            for n, marker in enumerate("abcd", 1):
                submit(jobs, marker)
                turns += turns_until(n)
            fd = conn.default_channel.client.connection._sock.fileno()
            assert turns >= 4 and registered.count(fd) <= 2  # kombu's own, then the tick's
            hub.remove_reader(fd)  # as kombu's pause of a BRPOP, or a disconnect, does
            submit(jobs, "e")
            turns_until(5)  # the tick added it again: the fetch is heard
            assert [m._raw["m"] for m in got] == ["a", "b", "c", "d", "e"]
    hub.close()


def test_a_wake_up_sends_the_fetch_in_the_turn_that_reads_it(redis_url, server, broker):
    """An idle channel woken on its wake-up list sends its fetch as it reads the wake-up
    (workers/broker/fetch.py `_fetch_now`), not at the event loop's next turn, whose timers
    and ticks (a task events' flush, the lease's beat) would go before it while the job
    that woke it waits: after the turn that reads the wake-up, the fetch is on its way, and
    no timer of the next turn has run before it."""
    from kombu.asynchronous import Hub

    hub = Hub()
    jobs = JobState(server)
    with kombu.Connection(redis_url, transport=REDIS_ALIAS) as conn:
        got: list = []
        with consumer(conn, got):
            conn.transport.register_with_event_loop(conn.connection, hub)
            channel = conn.default_channel
            read: list[str] = []  # after each read of the polling connection: what is in flight
            handlers = channel.handlers
            brpop = handlers["BRPOP"]

            def reading(**options):
                try:
                    return brpop(**options)
                finally:
                    read.append(channel._iq_reply)
            handlers["BRPOP"] = reading
            end = monotonic() + 10
            while channel._iq_reply != "wake" and monotonic() < end:
                hub.run_once()  # the first fetch finds nothing: the channel waits
            assert channel._iq_reply == "wake"
            read.clear()
            submit(jobs, "a")
            timer_saw: list = []
            while not read and monotonic() < end:
                hub.run_once()  # until the wake-up is read
            # What the channel has in flight when the next turn's callbacks run (the client's
            # own state: Redis may not have run a command sent a moment ago).
            hub.call_soon(lambda: timer_saw.append(channel._iq_reply))
            while not got and monotonic() < end:
                hub.run_once()
            assert [m._raw["m"] for m in got] == ["a"]
            assert read[0] == "fetch", "the wake-up's turn left the fetch to the next turn"
            assert timer_saw == ["fetch"]  # the next turn's callbacks found the fetch sent
    hub.close()
