"""Wakes `?wait` requests when their job finishes, and event streams when it moves, from one
subscription per API process, and bounds how many may wait at once.

Every move of a job is announced on the moves channel (tasks/keys.py), a batch of jobs a
message, ids only: "done <id> ..." for their terminal status, "running"/"progress" for the
others. One listener subscribes to it (and pattern-subscribes to the per-job done channels that
workers of earlier releases publish on), and sets the Event of whichever requests wait on those
jobs (on a move other than their end, only those that asked for every move: event streams): no
connection per waiting request, no subscription left behind, and no polling while the
subscription stands. It also subscribes to a reply channel of its own (tasks/keys.py
REPLY_PREFIX; with a client that does not decode replies, since a result is bytes): a job
submitted with `Prefer: wait` names it, and the job's finish sends there the job as a read
would find it, before its "done", so that the waiting request answers from it
(`answer`) without a read. Whenever it (re)subscribes it wakes every waiter once, since a job may
have finished while nobody listened; whenever it loses Redis it wakes them too, so that each
reads its job again (and its client hears of the outage). A message it cannot read (anyone
with the application's Redis user may publish on these channels) is logged and skipped; should
the listener end all the same, it wakes them as well, and they read their jobs every second
until the next wait starts it again. Under gunicorn's gevent worker
`threading` is gevent's, so the listener and each waiting request are greenlets, not threads.

A wait takes a slot: at most `max_waits` in the process and `max_per_key` per API key. A
request that finds no slot is told so at once (`NoSlot`) rather than queued behind others.
"""
from __future__ import annotations

import contextvars
import logging
import secrets
import threading
from collections import Counter

import redis

from tasks.jobstate import JobRecord, announced, announced_record
from tasks.keys import DONE_PREFIX, MOVES_CHANNEL, REPLY_PREFIX
from tasks.locks import short_lock

logger = logging.getLogger(__name__)

PREFIX = DONE_PREFIX


class NoSlot(Exception):
    """Every wait slot (of the process, or of this key) is taken; the message says which."""


class Slots:
    """The wait slots of one API process: at most `max_waits` in all, `max_per_key` per API
    key. The listeners of every Redis group (app/group_stores.py) share one."""

    def __init__(self, max_waits: int, max_per_key: int) -> None:
        self.max_waits, self.max_per_key = max_waits, max_per_key
        self._per_key: Counter[str] = Counter()
        self.count = 0
        self._lock = short_lock()  # held for a count's check and change only

    def take(self, owner: str | None) -> None:
        with self._lock:
            if self.count >= self.max_waits:
                raise NoSlot(f"this API process already holds {self.max_waits} waiting "
                             "requests")
            if owner and self._per_key[owner] >= self.max_per_key:
                raise NoSlot(f"this API key already holds {self.max_per_key} waiting "
                             "requests on this API process")
            self.count += 1
            if owner:
                self._per_key[owner] += 1

    def give_back(self, owner: str | None) -> None:
        with self._lock:
            self.count -= 1
            if owner:
                self._per_key[owner] -= 1
                if not self._per_key[owner]:
                    del self._per_key[owner]


class ResultWaiter:
    def __init__(self, client: redis.Redis, max_waits: int, max_per_key: int,
                 slots: Slots | None = None) -> None:
        self.client = client
        self.max_waits, self.max_per_key = max_waits, max_per_key
        self.slots = slots or Slots(max_waits, max_per_key)
        self._waiters: dict[str, set[threading.Event]] = {}
        self._movers: dict[str, set[threading.Event]] = {}  # those woken by every move
        self._lock = short_lock()  # the waiters' dicts: never held across a wait
        self._starting = threading.Lock()  # held while the listener's thread starts
        self._thread: threading.Thread | None = None
        self._listening = False  # the listener's thread runs (set under _starting)
        self._closed = threading.Event()
        self.subscribed = threading.Event()
        # The finished jobs announced on the reply channel, kept while someone waits on them.
        self._answers: dict[str, tuple[bytes, bytes, int]] = {}
        # None with a client that decodes replies: a result is not text.
        self.reply_channel = None if client.get_encoder().decode_responses else \
            REPLY_PREFIX + secrets.token_hex(8)

    def answer(self, job_id: str) -> JobRecord | None:
        """The job as its finish announced it on this listener's reply channel, if it did
        while a watch on it stood; None otherwise (read it)."""
        with self._lock:
            entry = self._answers.pop(job_id, None)
        return None if entry is None else announced_record(job_id, entry)

    @property
    def waiting(self) -> int:
        return self.slots.count

    def close(self) -> None:
        """Stop listening (an app that outlives its Redis, as in tests, stops retrying)."""
        self._closed.set()
        self._wake(None)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _start(self) -> None:
        """The listener started, unless it runs (or the waiter is closed). Whether it runs is
        its own flag, not `Thread.is_alive`: under gevent that is a lock tried without waiting,
        which, failing as it does while the listener runs, yields to gevent's hub: a trip
        through the event loop on every wait."""
        if self._listening:
            return
        with self._starting:
            if self._closed.is_set() or self._listening:
                return
            self._listening = True
            # In a context of its own: the request that starts it does not lend it its
            # deadline (tasks/redis_deadline.py).
            self._thread = threading.Thread(target=contextvars.Context().run,
                                            args=(self._listen_until_stopped,),
                                            name="iq-result-waiter", daemon=True)
            self._thread.start()

    def _listen_until_stopped(self) -> None:
        try:
            self._listen()
        finally:  # closed, or ended by an error it does not retry: the next wait restarts it
            # Nobody is woken by a message now: the parked waiters read their jobs for
            # themselves (every second) rather than sleep to their wait's end.
            self.subscribed.clear()
            self._wake(None)
            with self._starting:
                self._listening = False

    def _wake(self, job_id: str | None) -> None:
        """Set the Events of the job's waiters; of every waiter for None."""
        with self._lock:
            if job_id is None:
                events = [e for group in self._waiters.values() for e in group]
            else:
                events = list(self._waiters.get(job_id, ()))
        for event in events:
            event.set()

    def _moved(self, message: str) -> None:
        """A moves message, "<move> <id> <id> ...": wake those watching every move of these
        jobs, and on "done" those waiting for their end too."""
        move, *ids = message.split()
        groups = (self._movers, self._waiters) if move == "done" else (self._movers,)
        with self._lock:
            events = [e for group in groups for job_id in ids for e in group.get(job_id, ())]
        for event in events:
            event.set()

    def _answered(self, message: bytes) -> None:
        """A finish's jobs on the reply channel: kept for those watched (their "done" follows
        on the moves channel, which wakes them), dropped for the others."""
        jobs = announced(message)
        with self._lock:
            for job_id, entry in jobs.items():
                if job_id in self._waiters:
                    self._answers[job_id] = entry

    def _listen(self) -> None:
        backoff = 0.1
        while not self._closed.is_set():
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.psubscribe(PREFIX + "*")
                pubsub.subscribe(MOVES_CHANNEL, *filter(None, [self.reply_channel]))
                while not self._closed.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    # psubscribe's confirmation has been read once get_message returns.
                    if not self.subscribed.is_set():
                        # Whatever finished while no one listened, woken before `subscribed`
                        # says so: once it is set, every waiter has had that wake-up.
                        self._wake(None)
                        self.subscribed.set()
                    backoff = 0.1
                    if message is None:
                        continue
                    self._heard(message)
            except redis.RedisError as exc:
                if self.subscribed.is_set():
                    self.subscribed.clear()
                    # Nobody can be woken by a message now: every waiter looks for itself,
                    # and a client whose job cannot be read is told Redis is away (503).
                    self._wake(None)
                logger.warning("result listener lost Redis (%s); reconnecting", exc)
                self._closed.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                try:
                    pubsub.close()
                except redis.RedisError:
                    pass

    def _heard(self, message: dict) -> None:
        """One message of the subscription. One that is not ours (anyone with the
        application's Redis user may publish on these channels) is logged and skipped: it
        must not end the listener, and with it the wake-ups of every parked wait."""
        try:
            channel = _text(message["channel"])
            if message["type"] != "message":
                self._wake(channel[len(PREFIX):])
            elif channel == self.reply_channel:
                self._answered(message["data"])
            else:
                self._moved(_text(message["data"]))
        except ValueError as exc:  # UnicodeDecodeError included
            logger.warning("result listener skipped a malformed message on %r (%s)",
                           message.get("channel"), exc)

    def watch(self, job_id: str, owner: str | None = None, moves: bool = False) -> Watching:
        """An Event set when `job_id` reaches a terminal status (or the listener has just
        resubscribed), for the `with` block's life; with `moves`, also when it starts running
        or counts progress. `owner` is the API key's name ("" or None: no key). Raises NoSlot
        when no wait slot is free."""
        return Watching(self, job_id, owner, moves)


class Watching:
    """`ResultWaiter.watch`'s block: a class, not a generator's context manager (~5 calls
    fewer at each wait, issue 40)."""

    __slots__ = ("waiter", "job_id", "owner", "groups", "event")

    def __init__(self, waiter: ResultWaiter, job_id: str, owner: str | None,
                 moves: bool) -> None:
        self.waiter, self.job_id, self.owner = waiter, job_id, owner
        self.groups = (waiter._waiters, waiter._movers) if moves else (waiter._waiters,)

    def __enter__(self) -> threading.Event:
        waiter, job_id = self.waiter, self.job_id
        waiter._start()
        event = self.event = threading.Event()
        waiter.slots.take(self.owner)
        with waiter._lock:
            for group in self.groups:
                group.setdefault(job_id, set()).add(event)
        return event

    def __exit__(self, *exc: object) -> None:
        waiter, job_id, event = self.waiter, self.job_id, self.event
        waiter.slots.give_back(self.owner)
        with waiter._lock:
            for group in self.groups:
                found = group.get(job_id)
                if found is not None:
                    found.discard(event)
                    if not found:
                        del group[job_id]
            if job_id not in waiter._waiters:
                waiter._answers.pop(job_id, None)

def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
