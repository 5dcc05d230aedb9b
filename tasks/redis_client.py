"""The Redis clients this project opens itself (the API's store, the workers' job-state and
lease clients), all configured one way: bounded timeouts so that a dead Redis is an error in
seconds rather than a hang, and redis-py's retries with backoff for a dropped connection."""
from __future__ import annotations

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from config import Settings


def connect(url: str, settings: Settings, *, decode: bool = True,
            max_connections: int | None = None) -> redis.Redis:
    """A client of `url`. With `max_connections`, its pool blocks: a caller past that many
    connections in use waits (up to redis_timeout_s) for one to be free instead of failing
    with "Too many connections" (redis-py's default pool stops at 100), as the API's
    thousands of concurrent requests must."""
    retry = Retry(ExponentialWithJitterBackoff(base=0.1, cap=1.0), 3)
    options = dict(
        socket_timeout=max(settings.redis_timeout_s, 5.0),
        socket_connect_timeout=settings.redis_timeout_s,
        health_check_interval=30,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        decode_responses=decode,
    )
    if max_connections is None:
        return redis.Redis.from_url(url, **options)
    pool = redis.BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                 timeout=settings.redis_timeout_s, **options)
    return redis.Redis(connection_pool=pool, retry=retry)


def is_out_of_memory(exc: BaseException) -> bool:
    """Redis at maxmemory (with noeviction) refusing a write: redis-py's OutOfMemoryError, or
    the same refusal in other words (inside a script it reaches redis-py as a plain
    ResponseError; kombu wraps it in its OperationalError)."""
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or \
        "OOM command not allowed" in str(exc)


def is_transient(exc: BaseException) -> bool:
    """A Redis error that says nothing about the job: the server is away, restarting,
    loading its data, or out of memory for now. Worth retrying, never a job failure."""
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return True  # BusyLoadingError (Redis loading its data) is a ConnectionError
    if is_out_of_memory(exc):
        return True
    return isinstance(exc, redis.ResponseError) and \
        str(exc).startswith(("LOADING", "MASTERDOWN", "READONLY", "TRYAGAIN"))
