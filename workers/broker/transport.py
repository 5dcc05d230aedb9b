"""The worker's kombu transports: kombu's Redis and Redis Sentinel transports, subclassed, whose
channels fetch through the worker's in-flight record (fetch.py) and open the worker's clients
(clients.py), and whose event loop renews the worker's lease every heartbeat and adds kombu's
sockets to the loop once rather than at every turn.

A worker selects them by configuration when it starts (`select`, from workers/broker/
broker.py's `attach`): `broker_transport` names the transport registered here under an alias
of kombu's TRANSPORT_ALIASES (`iqredis`, `iqsentinel`), and `broker_failover_strategy` (one
registered in kombu's `failover_strategies`) keeps it across a failover to the next sentinel
(kombu's `Connection.switch` takes the transport from the next URL's scheme, which would
otherwise be kombu's own). The API, Flower, the celery
CLI and a worker's pool children open kombu's transports as shipped."""
from __future__ import annotations

import logging
import weakref
from itertools import cycle
from typing import Any, Iterable, Iterator

import redis
from kombu.connection import failover_strategies
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

from workers.broker.fetch import ReliableChannel, ReliableFetch, ReliableSentinelChannel
from workers.broker.broker import installed

logger = logging.getLogger(__name__)

# The aliases, each for the scheme of the URLs it serves (kombu's own: redis, rediss, sentinel).
REDIS_ALIAS = "iqredis"
SENTINEL_ALIAS = "iqsentinel"
# The failover strategy, by the name kombu's `failover_strategies` knows it (a setting's value
# must be plain data: `celery inspect conf` and `stats` send it as JSON).
FAILOVER = "iq-keep-transport"
_SCHEMES = {"redis": REDIS_ALIAS, "rediss": REDIS_ALIAS, "sentinel": SENTINEL_ALIAS,
            "redis+socket": REDIS_ALIAS}
# A Unix socket's URL (tasks/celery_app.py's `socket_url`) names kombu's Redis transport
# before its `+`, which a URL's transport outranks a configured one: the worker's names its own.
_SOCKET = "redis+socket://"


class _BeatOnTheEventLoop:
    """The worker's lease is pushed forward every heartbeat by its event loop, through the
    channel that consumes: whatever else the worker does, no message is renewed one by one."""

    _beat_tref: Any = None
    _iq_loop: Any = None  # the event loop, for a held fetch's timer (fetch.py)

    def register_with_event_loop(self, connection: Any, loop: Any) -> Any:
        out = super().register_with_event_loop(connection, loop)
        self._iq_loop = loop
        state = installed()
        if state is None:
            raise RuntimeError("the worker's transport runs only with its Broker installed")
        if self._beat_tref is not None:
            self._beat_tref.cancel()
        self._beat_tref = loop.call_repeatedly(state.heartbeat_s, _beat, self.cycle)
        return out


class _KeepRegistrations:
    """kombu's Redis transport adds each of its sockets to the event loop again at every turn
    (`add_reader` in the tick that `register_with_event_loop` adds), and each time epoll
    answers that it holds it already: 1.6 registrations a job in the worker's main process.
    This tick, in place of kombu's, does what kombu's does but adds a socket only where the
    loop does not hold it, for this reader, since this tick added it (`_poll_start`)."""

    def register_with_event_loop(self, connection: Any, loop: Any) -> Any:
        before = set(loop.on_tick)
        out = super().register_with_event_loop(connection, loop)  # type: ignore[misc]
        added = [tick for tick in loop.on_tick if tick not in before]
        if len(added) == 1:  # kombu's tick (any other shape: kombu's ticks as they are)
            loop.on_tick.discard(added[0])
            tick = _poll_start(self.cycle, loop, self.on_readable)  # type: ignore[attr-defined]
            loop.on_tick.add(tick)
        return out


def _poll_start(poller: Any, loop: Any, on_readable: Any) -> Any:
    """kombu's tick (`MultiChannelPoller.on_poll_start`, then each of its sockets added to the
    loop), adding a socket again only when the loop may not hold it: another reader under its
    fd (kombu's pause of a BRPOP, a disconnect, remove it from the loop), or the socket added
    under that fd closed (a reconnect's, the kernel drops it from epoll) or not known. kombu's
    own re-registrations (`_register` after a reconnect) go to epoll themselves."""
    held: dict[int, Any] = {}  # fd -> the socket this tick added under it (a weak reference)

    def on_poll_start() -> None:
        poller.on_poll_start()
        readers = loop.readers
        for fd in poller.fds:
            ref = held.get(fd)
            sock = ref() if ref is not None else None
            if sock is not None and sock.fileno() == fd and \
                    readers.get(fd) == (on_readable, (fd,)):
                continue
            loop.add_reader(fd, on_readable, fd)
            sock = next((s for s in poller._chan_to_sock.values()
                         if s is not None and s.fileno() == fd), None)
            held[fd] = weakref.ref(sock) if sock is not None else None
    return on_poll_start


def _beat(poller: Any) -> None:
    for channel in list(poller._channels):
        if isinstance(channel, ReliableFetch) and channel._iq_consuming and not channel.closed:
            try:
                channel.inflight.beat()
            except redis.RedisError as exc:
                logger.warning("could not renew this worker's lease: %s", exc)
            return


class Transport(_KeepRegistrations, _BeatOnTheEventLoop, kombu_redis.Transport):
    """kombu's Redis transport, with the worker's fetch."""

    Channel = ReliableChannel


class SentinelTransport(_KeepRegistrations, _BeatOnTheEventLoop,
                        kombu_redis.SentinelTransport):
    """kombu's Redis Sentinel transport, with the worker's fetch."""

    Channel = ReliableSentinelChannel




def alias_for(url: str) -> str:
    """The worker's transport for a broker URL (its first, for a `;`-separated list)."""
    scheme = url.split(";", 1)[0].partition("://")[0]
    try:
        return _SCHEMES[scheme]
    except KeyError:
        raise ValueError(f"broker_url: the worker fetches from Redis only (redis://, "
                         f"rediss://, sentinel://, redis+socket://), got {scheme!r}") from None


def keep_the_transport(urls: Iterable[str]) -> Iterator[str]:
    """kombu's round-robin failover over the broker's URLs, each with the scheme of the
    worker's transport, so that `Connection.switch` keeps it."""
    for url in cycle(list(urls)):
        scheme, sep, rest = url.partition("://")
        yield f"{_SCHEMES.get(scheme, scheme)}{sep}{rest}" if sep else url


TRANSPORT_ALIASES.setdefault(REDIS_ALIAS, f"{__name__}:Transport")
TRANSPORT_ALIASES.setdefault(SENTINEL_ALIAS, f"{__name__}:SentinelTransport")
failover_strategies.setdefault(FAILOVER, keep_the_transport)


def select(app: Any) -> None:
    """The worker's transports for `app`'s connections (a worker's main process, at start)."""
    app.conf.broker_transport = alias_for(app.conf.broker_url)
    app.conf.broker_failover_strategy = FAILOVER
    if app.conf.broker_url.startswith(_SOCKET):
        app.conf.broker_url = f"{REDIS_ALIAS}+socket://{app.conf.broker_url[len(_SOCKET):]}"
