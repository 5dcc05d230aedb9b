"""The Redis clients this project opens itself (the API's store, the workers' job-state and
lease clients, the webhook deliverer's), all configured one way, and which Redis errors are
transient.

* Bounded. A worker's client times out in seconds and retries a dropped connection or a
  timeout a few times with backoff: it rides out a restart. The API's client takes a deadline
  (`redis_deadline_s`) for each call, retries included: a dropped connection is retried while
  the call is younger than it, a timeout never (it has spent the deadline already, and the
  command may have run), so a frozen or unreachable Redis is a 503 within the deadline.
  Within a request (tasks/redis_deadline.py) every wait of its calls on a connection, the
  pool or a retry is cut to what is left of the request's one deadline, so that its calls
  together, not each of them, fit in it.
* Sentinel. With `redis_sentinels` set, every client asks the sentinels where the primary is
  when it connects (redis-py's Sentinel support), and again after its connection to a former
  primary fails: no restart is needed after a failover. Within a request that asking is cut to
  what is left of the request's deadline too (`DeadlineSentinel`): a frozen sentinel once held
  a request near its deadline for a sentinel's own timeout past it.
"""
from __future__ import annotations

import re
import time
from typing import Any, Callable, TypeVar

import redis
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.connection import (Encoder, HiredisRespSerializer, SSLConnection,
                              UnixDomainSocketConnection, parse_url)
from redis.retry import Retry
from redis.sentinel import (MasterNotFoundError, Sentinel, SentinelConnectionPool,
                            SentinelManagedConnection)
from redis.utils import HIREDIS_AVAILABLE

from config import Settings
from tasks import redis_deadline

if HIREDIS_AVAILABLE:
    import hiredis

T = TypeVar("T")


class DeadlineRetry(Retry):
    """redis-py's retries bounded by time: a dropped or refused connection is retried with
    backoff while another try, as long as the last one, still fits in `deadline_s` from the
    call's start (and in what is left of the request's deadline); a timeout is not retried at
    all."""

    def __init__(self, deadline_s: float) -> None:
        super().__init__(ExponentialWithJitterBackoff(base=0.05, cap=0.5), -1,
                         (redis.ConnectionError,))
        self.deadline_s = deadline_s

    def call_with_retry(self, do: Callable[[], T], fail: Callable[..., Any],
                        is_retryable: Callable[[Exception], bool] | None = None,
                        with_failure_count: bool = False) -> T:
        started = time.monotonic()
        self._backoff.reset()
        failures = 0
        while True:
            tried = time.monotonic()
            try:
                return do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                now, pause = time.monotonic(), self._backoff.compute(failures)
                left = self.deadline_s - (now - started)
                request = redis_deadline.current()
                if request is not None:
                    left = min(left, request.remaining())
                if pause + (now - tried) >= left:
                    raise
                time.sleep(pause)


class DeadlineConnection:
    """A connection whose every wait on its socket (connecting, each send and each read, the
    handshake's included) is cut to what is left of the request's deadline
    (tasks/redis_deadline.py); outside a request, its own timeouts. Mixed into redis-py's
    connection classes (DEADLINE_CONNECTIONS)."""

    socket_timeout: float | None
    socket_connect_timeout: float | None
    _sock: Any

    def _connect(self) -> Any:
        configured = self.socket_connect_timeout
        self.socket_connect_timeout = redis_deadline.bound(configured)
        try:
            sock = super()._connect()  # type: ignore[misc]
        finally:
            self.socket_connect_timeout = configured
        request = redis_deadline.current()
        if request is not None:  # until the first send or read bounds it again
            sock.settimeout(max(min(self.socket_timeout or 1e9, request.remaining()), 0.001))
        return sock

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        self._bound()
        super().send_packed_command(command, check_health)  # type: ignore[misc]

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            self._bound()
        except redis_deadline.DeadlinePassed:
            self.disconnect()  # type: ignore[attr-defined]  # its reply may still come
            raise
        return super().read_response(*args, **kwargs)  # type: ignore[misc]

    def _bound(self) -> None:
        if self._sock is not None:
            self._sock.settimeout(redis_deadline.bound(self.socket_timeout))


class DeadlinePool:
    """A blocking pool whose wait for a free connection is cut to what is left of the
    request's deadline. Mixed into redis-py's BlockingConnectionPool, which reads `timeout`
    at each wait."""

    _timeout: float | None

    @property
    def timeout(self) -> float | None:
        request = redis_deadline.current()
        if request is None or self._timeout is None:
            return self._timeout
        return max(0.0, min(self._timeout, request.remaining()))

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._timeout = value


class DeadlineBlockingPool(DeadlinePool, redis.BlockingConnectionPool):
    pass


class SentinelConnection(SentinelManagedConnection):
    """redis-py's connection to the primary the sentinels name, dropped when a read fails as
    every other redis-py connection is. redis-py's own keeps it (its `read_response` defaults
    to `disconnect_on_error=False`): a command that timed out (a frozen Redis) left its reply
    unread on a connection that went back to the pool, and the next command sent on it read
    that reply as its own. In the game day that gave submits other jobs' answers, 500s, and
    jobs answered 202 that were never recorded."""

    def read_response(self, *args: Any, disconnect_on_error: bool = True,
                      **kwargs: Any) -> Any:
        return super().read_response(*args, disconnect_on_error=disconnect_on_error, **kwargs)


class SentinelSSLConnection(SentinelConnection, SSLConnection):
    """The same over TLS (as redis-py's SentinelManagedSSLConnection)."""


class BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """redis-py's Sentinel pool (the primary looked up at each connect) with the blocking
    pool's bound on connections, which redis-py does not ship for Sentinel."""


class DeadlineSentinelPool(DeadlinePool, BlockingSentinelPool):
    pass


class _DeadlinePlain(DeadlineConnection, redis.Connection):
    pass


class DeadlineSentinel(Sentinel):
    """redis-py's Sentinel whose asking, within a request, fits in what is left of the
    request's deadline (tasks/redis_deadline.py): each sentinel's connection waits no longer
    than that (its own timeouts outside a request), and a lookup that ran out of it says so
    (DeadlinePassed, a timeout: not retried) rather than that no sentinel knows the primary
    (a connection error, which the client's retries would try again). Before, a lookup after
    a failover waited out each frozen sentinel's socket timeout, however little of the
    request's deadline was left."""

    def __init__(self, sentinels: list, **kwargs: Any) -> None:
        super().__init__(sentinels, **kwargs)
        for client in self.sentinels:  # redis-py builds them; their pools make connections
            client.connection_pool.connection_class = _DeadlinePlain

    def discover_master(self, service_name: str) -> Any:
        try:
            return super().discover_master(service_name)
        except MasterNotFoundError as exc:
            request = redis_deadline.current()
            if request is not None and request.remaining() <= 0:
                raise redis_deadline.DeadlinePassed(
                    f"the request's deadline ({request.seconds:g}s) passed while the sentinels "
                    f"were asked for {service_name!r}'s primary ({exc})") from None
            raise


class _DeadlineSSL(DeadlineConnection, SSLConnection):
    pass


class _DeadlineUnix(DeadlineConnection, UnixDomainSocketConnection):
    pass


class _DeadlineSentinel(DeadlineConnection, SentinelConnection):
    pass


class _DeadlineSentinelSSL(DeadlineConnection, SentinelSSLConnection):
    pass


# Each connection class redis-py picks for a URL (or Sentinel), with the request's deadline.
DEADLINE_CONNECTIONS: dict[type, type] = {
    redis.Connection: _DeadlinePlain, SSLConnection: _DeadlineSSL,
    UnixDomainSocketConnection: _DeadlineUnix, SentinelConnection: _DeadlineSentinel,
    SentinelSSLConnection: _DeadlineSentinelSSL}


class HiredisPacker(HiredisRespSerializer):
    """redis-py's command packer with hiredis (a connection's `command_packer`), without its
    pass over every argument: redis-py's rebuilds the arguments as a tuple, asking of each
    whether it is a bytearray or a memoryview, before hiredis packs them (37 checks for a
    submit's script call). hiredis packs the tuple of str, int, float and bytes it is given
    the same; any other argument is a TypeError, on which redis-py's packer takes the command
    as before (a bytearray converted, anything else refused with its DataError). A command
    name that is not one word of letters is redis-py's to split: it splits a name on any
    whitespace (`CLIENT SETNAME` is two words, and so it is with a tab for the space).
    An argument of a type neither takes is refused with redis-py's own words, which name its
    type (hiredis's do not); so is a subclass of int (an IntEnum, an IntFlag), which hiredis
    refuses, as it does under redis-py's own hiredis packer, where redis-py's encoder would
    send its repr (`<Level.LOW: 1>`)."""

    _ENCODER = Encoder("utf-8", "strict", False)

    def pack(self, *args: Any) -> list[bytes]:
        if type(args[0]) is str and args[0].isalpha():
            try:
                return [hiredis.pack_command(args)]
            except TypeError:
                pass
        try:
            return super().pack(*args)
        except redis.DataError as exc:
            for arg in args:  # the first redis-py's encoder refuses, by its type
                try:
                    self._ENCODER.encode(arg)
                except redis.DataError as named:
                    raise named from exc
                if isinstance(arg, int) and type(arg) is not int:  # an IntEnum, an IntFlag
                    raise redis.DataError(
                        f"Invalid input of type: '{type(arg).__name__}' ({arg!r}): hiredis "
                        "packs no subclass of int. Convert to an int first.") from exc
            raise


# Every client's connections share it (it holds nothing); None: redis-py's own packer.
COMMAND_PACKER = HiredisPacker() if HIREDIS_AVAILABLE else None


def connect(url: str, settings: Settings, *, decode: bool = True,
            max_connections: int | None = None,
            deadline_s: float | None = None) -> redis.Redis:
    """A client of `url` (or of the primary the sentinels name, with `url`'s credentials).
    `deadline_s`: the longest one call may take, retries included (the API's); without it,
    a worker's retries. With `max_connections`, its pool blocks: a caller past that many
    connections in use waits (up to the deadline, or redis_timeout_s) for one to be free
    instead of failing with "Too many connections" (redis-py's default pool stops at 100), as
    the API's thousands of concurrent requests must. With `deadline_s`, each wait is also cut
    to what is left of the request's deadline (tasks/redis_deadline.py), if any."""
    if deadline_s is None:
        retry: Retry = Retry(ExponentialWithJitterBackoff(base=0.1, cap=1.0), 3)
        retry_on: list[type[Exception]] = [redis.ConnectionError, redis.TimeoutError]
        read_s, connect_s = max(settings.redis_timeout_s, 5.0), settings.redis_timeout_s
    else:
        retry, retry_on = DeadlineRetry(deadline_s), [redis.ConnectionError]
        read_s, connect_s = deadline_s, min(settings.redis_timeout_s, deadline_s)
    options: dict[str, Any] = dict(
        socket_timeout=read_s, socket_connect_timeout=connect_s, health_check_interval=30,
        retry=retry, retry_on_error=retry_on, decode_responses=decode,
        command_packer=COMMAND_PACKER)
    blocking = {} if max_connections is None else {
        "max_connections": max_connections, "timeout": deadline_s or settings.redis_timeout_s}
    bounded = deadline_s is not None
    if settings.sentinel_hosts:
        return _primary(url, settings, options, blocking, bounded)
    if bounded:
        options["connection_class"] = DEADLINE_CONNECTIONS[
            parse_url(url).get("connection_class", redis.Connection)]
    if not blocking:
        return redis.Redis.from_url(url, **options)
    pool_class = DeadlineBlockingPool if bounded else redis.BlockingConnectionPool
    pool = pool_class.from_url(url, **blocking, **options)
    return redis.Redis(connection_pool=pool, retry=retry)


def sentinel_options(settings: Settings, timeout_s: float) -> dict[str, Any]:
    """How the sentinels are asked (redis-py's `sentinel_kwargs`; kombu's and Celery's too):
    their own credentials, and a timeout per sentinel such that asking all of them in turn,
    a frozen one included, fits in `timeout_s` twice over."""
    each = min(settings.redis_timeout_s, timeout_s / (2 * len(settings.sentinel_hosts)))
    options: dict[str, Any] = {"socket_timeout": each, "socket_connect_timeout": each}
    if settings.redis_sentinel_user:
        options["username"] = settings.redis_sentinel_user
    if settings.redis_sentinel_password:
        options["password"] = settings.redis_sentinel_password
    return options


def _primary(url: str, settings: Settings, options: dict[str, Any],
             blocking: dict[str, Any], bounded: bool = False) -> redis.Redis:
    """A client of the primary the sentinels name, with `url`'s user, password, database and
    TLS options (its host is not used)."""
    params = parse_url(url)
    params.pop("host", None)
    params.pop("port", None)
    tls = params.pop("connection_class", None) is SSLConnection
    params["connection_class"] = SentinelSSLConnection if tls else SentinelConnection
    if bounded:
        params["connection_class"] = DEADLINE_CONNECTIONS[params["connection_class"]]
    sentinels = dict(sentinel_options(settings, options["socket_timeout"]),
                     retry=Retry(NoBackoff(), 0))
    sentinel = (DeadlineSentinel if bounded else Sentinel)(
        settings.sentinel_hosts, sentinel_kwargs=sentinels, **options, **params)
    pool_class = BlockingSentinelPool if blocking else SentinelConnectionPool
    if bounded and blocking:
        pool_class = DeadlineSentinelPool
    return sentinel.master_for(settings.redis_master, connection_pool_class=pool_class,
                               **blocking)


def is_out_of_memory(exc: BaseException) -> bool:
    """Redis at maxmemory (with noeviction) refusing a write: redis-py's OutOfMemoryError, or
    the same refusal in other words (inside a script it reaches redis-py as a plain
    ResponseError; kombu wraps it in its OperationalError)."""
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or \
        "OOM command not allowed" in str(exc)


# Redis's refusals that say nothing about the command: loading its data, no primary, a
# replica now (a failover), a cluster's moment, a primary without a replica in sync
# (min-replicas-to-write: make run's with replicas).
TRANSIENT_CODES = ("LOADING", "MASTERDOWN", "READONLY", "TRYAGAIN", "NOREPLICAS")
# The code first, as Redis sends it; or after a dash (a script's error: `... -NOREPLICAS Not
# enough good replicas`) or a colon (a pipeline's: `... of pipeline caused error: NOREPLICAS`).
_TRANSIENT = re.compile(rf"(?:^|-|: )(?:{'|'.join(TRANSIENT_CODES)}) ")


def is_transient(exc: BaseException) -> bool:
    """A Redis error that says nothing about the job: the server is away, restarting,
    loading its data, out of memory for now, or refusing writes until a failover settles.
    Worth retrying, never a job failure."""
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return True  # BusyLoadingError (Redis loading its data) is a ConnectionError
    if is_out_of_memory(exc) or isinstance(exc, redis.exceptions.ReadOnlyError):
        return True  # redis-py's READONLY, its code taken off the message
    return isinstance(exc, redis.ResponseError) and bool(_TRANSIENT.search(str(exc)))
