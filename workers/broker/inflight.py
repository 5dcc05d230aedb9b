"""`InFlight`: one worker process's in-flight record and lease in Redis (the keys and scripts of
workers/broker/lua.py), through whichever client the caller has: the kombu channel's (the
fetch, the beat, the recovery) or the dispatcher's own (a batch's acknowledgements).

* The lease is one key per worker process whose expiry, on Redis's clock, the worker pushes
  forward every heartbeat (`beat`), a PEXPIRE that Redis takes even when it is full. Every
  message on the worker's in-flight hash is leased by it: nothing is renewed per message, and
  no worker's clock is read.
* A message leaves the hash by an acknowledgement (one HDEL for a whole batch) or by going
  back to its queue (`restore`, one script).
* Recovery (`reap`, from any live worker every few seconds): the in-flight messages of every
  worker whose lease is gone go back to their queues; an earlier incarnation of this worker's
  own node name (it was killed and started again) as soon as it missed three beats.
* The second line (`reconcile`): a job not final for longer than a lease whose message is on
  no queue and on no in-flight hash is queued again from its record.
"""
from __future__ import annotations

import logging
from time import monotonic
from typing import Any, Iterable

from kombu.utils.encoding import bytes_to_str

from tasks.keys import PENDING_KEY, delayed_key
from workers.broker import lua
from workers.broker.broker import Broker

logger = logging.getLogger(__name__)

# Jobs the reconciler looks at in one pass, at most.
RECONCILE_LIMIT = 100
# Beats an earlier incarnation of this node may miss before its messages are taken back.
MISSED_BEATS = 3


def fetch_call(state: Broker, lists: list[str], want: int,
               delayed: Iterable[str] = ()) -> tuple[list[str], list[Any]]:
    """FETCH's keys and arguments: take up to `want` messages from `lists` (in the order they
    are served), moving the due messages of the `delayed` sets onto their lists first."""
    return [state.inflight_key, state.alive_key, *lists, *delayed], [want, len(lists)]


def fetched(reply: list) -> list[tuple[str, str]] | None:
    """FETCH's reply as (list, message) pairs, oldest first; None when the worker holds no
    lease."""
    if bytes_to_str(reply[0]) == "nolease":
        return None
    rest = reply[1:]
    return [(bytes_to_str(k), bytes_to_str(m)) for k, m in zip(rest[::2], rest[1::2])]


class InFlight:
    def __init__(self, client: Any, state: Broker) -> None:
        self.client = client
        self.state = state
        self._fetch = client.register_script(lua.FETCH)
        self._beat = client.register_script(lua.BEAT)
        self._restore = client.register_script(lua.RESTORE)
        self._reap = client.register_script(lua.REAP)
        self._reconcile = client.register_script(lua.RECONCILE)
        self._later = client.register_script(lua.LATER)

    def beat(self) -> bool:
        """Push this worker's lease forward, or make it (again). True when it was still held."""
        state = self.state
        renewed = bool(self._beat(keys=[state.alive_key, lua.FETCHERS_KEY],
                                  args=[state.incarnation, state.node,
                                        int(state.lease_s * 1000)]))
        if not renewed:
            if state.lease_since is not None:
                logger.warning("this worker's lease had lapsed (Redis was out of reach for "
                               "longer than %gs): other workers may have taken back the jobs "
                               "it held; those it has not started it leaves to them",
                               state.lease_s)
            state.lease_since = monotonic()
        return renewed

    def take(self, lists: list[str], want: int,
             delayed: Iterable[str] = ()) -> list[tuple[str, str]] | None:
        """Up to `want` messages onto the in-flight hash; None when this worker holds no
        lease."""
        keys, args = fetch_call(self.state, lists, want, delayed)
        return fetched(self._fetch(keys=keys, args=args))

    def load_fetch(self) -> str:
        """The fetch script into Redis's script cache; its hash. The channel sends it by hash
        (EVALSHA) on its polling connection, where redis-py's retry on NOSCRIPT does not
        apply: loaded when a channel starts consuming, and again after Redis lost it."""
        return str(self.client.script_load(self._fetch.script))

    def fetch_sha(self) -> str:
        return str(self._fetch.sha)

    def ack(self, tags: Iterable[str]) -> None:
        """Done with these: off the in-flight hash for good (one command)."""
        tags = list(tags)
        if tags:
            self.client.hdel(self.state.inflight_key, *tags)

    def put_aside(self, tag: str, raw: str) -> None:
        """A message the worker cannot read, off the in-flight hash onto MALFORMED_KEY (where
        the fetch puts what it cannot read itself), in one step: never delivered, never
        requeued to be fetched again."""
        with self.client.pipeline(transaction=True) as pipe:
            pipe.hdel(self.state.inflight_key, tag)
            pipe.rpush(lua.MALFORMED_KEY, raw)
            pipe.execute()

    def restore(self, tags: Iterable[str]) -> int:
        """Back to the head of their queues, the first of `tags` to be served first; returns
        how many were still on the in-flight hash."""
        tags = list(tags)
        if not tags:
            return 0
        return int(self._restore(keys=[self.state.inflight_key], args=tags))

    def later(self, tag: str, delay_s: float, queue: str, list_key: str, message: bytes) -> bool:
        """Instead of the message held under `tag`, `message` on `queue`'s delayed set, due
        in `delay_s` (its list: `list_key`); False when this worker no longer held it."""
        entry = list_key.encode() + b"\n" + message
        return bool(self._later(keys=[self.state.inflight_key, delayed_key(queue)],
                                args=[tag, delay_s, entry]))

    def recover(self) -> int:
        """Back to their queues: the messages of the in-flight hash this process has no use
        for (a fetch whose reply was lost with its connection). Returns how many."""
        held = {bytes_to_str(t) for t in self.client.hkeys(self.state.inflight_key)}
        lost = sorted(held - self.state.known_tags())
        restored = self.restore(lost)
        if restored:
            logger.warning("%d message(s) this worker had taken but never received (a reply "
                           "lost with its connection) back on their queues", restored)
        return restored

    def reap(self) -> int:
        """Every message of the workers that stopped beating back on its queue; how many."""
        state = self.state
        trusted = state.lease_since is not None and monotonic() - state.lease_since >= \
            state.lease_s
        out = self._reap(keys=[lua.FETCHERS_KEY],
                         args=[state.incarnation, state.node, int(state.lease_s * 1000),
                               int(MISSED_BEATS * state.heartbeat_s * 1000),
                               "1" if trusted else "0"])
        moved, gone = int(out[0]), [bytes_to_str(x) for x in out[1:]]
        if gone:
            logger.warning("%d message(s) of %d worker(s) that stopped beating back on their "
                           "queues: %s", moved, len(gone), ", ".join(gone))
        return moved

    def reconcile(self) -> list[str]:
        """Jobs whose message was nowhere, queued again (at most one worker at a time does
        it, now and then)."""
        state = self.state
        out = self._reconcile(keys=[PENDING_KEY, lua.FETCHERS_KEY, lua.RECONCILE_MUTEX],
                              args=[state.incarnation, state.lease_s, RECONCILE_LIMIT,
                                    int(max(state.lease_s / 6, 1) * 1000)])
        again = [bytes_to_str(x) for x in out[1:]]
        for job_id in again:
            logger.warning("job %s was not final after %gs and its message was on no queue "
                           "and with no worker: queued again from its record", job_id,
                           state.lease_s)
        return again
