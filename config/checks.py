"""Each setting's bounds, checked once when the settings are loaded (config/settings.py): every
error names the setting and the value it got."""
from __future__ import annotations

import ipaddress
import os
from typing import Any
from urllib.parse import parse_qsl, urlsplit

# kombu's most messages a QoS limits (kombu.common.PREFETCH_COUNT_MAX): past it, none. Not
# imported: config/ is loaded by gunicorn's master before gevent patches the standard library
# (gunicorn.conf.py), and takes no library then (tests/unit/test_config.py checks it is kombu's).
PREFETCH_COUNT_MAX = 0xFFFF

# The checks take config.settings.Settings, not imported here: settings.py imports this module.
Settings = Any


class ConfigError(ValueError):
    """A setting or a model declaration is wrong; the message names it."""


def check(settings: Settings) -> None:
    """Raise ConfigError for the first setting out of its bounds."""
    _check_access(settings)
    _check_images(settings)
    _check_redis(settings)
    _check_workers(settings)


def _check_access(settings: Settings) -> None:
    """The API's and the deliverer's limits."""
    if settings.max_wait_s <= 0 or settings.max_wait_s > 300:
        raise ConfigError(f"max_wait_s must be in (0, 300], got {settings.max_wait_s}")
    if settings.log_format not in ("text", "json"):
        raise ConfigError(f"log_format must be text or json, got {settings.log_format!r}")
    if settings.run_users not in ("one", "separate"):
        raise ConfigError(f"run_users must be one or separate, got {settings.run_users!r}")
    for name in ("kept_inputs_ttl_s", "kept_inputs_max_bytes"):
        if getattr(settings, name) < 0:
            raise ConfigError(f"{name} must be an integer >= 0, got {getattr(settings, name)}")
    if not 0 <= settings.redis_memory_headroom < 1:
        raise ConfigError("redis_memory_headroom must be in [0, 1), got "
                          f"{settings.redis_memory_headroom}")
    for name in ("max_waits", "max_waits_per_key"):
        if getattr(settings, name) < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {getattr(settings, name)}")
    for name in ("kept_bytes_per_key", "max_uploads_per_key", "read_burst_per_key"):
        if getattr(settings, name) < 0:
            raise ConfigError(f"{name} must be an integer >= 0, got {getattr(settings, name)}")
    # A waiting job's request counts against the quota whatever its size: any body must fit.
    floor = max(("kept_inputs_max_bytes", settings.kept_inputs_max_bytes),
                ("max_body_bytes", settings.max_body_bytes), key=lambda item: item[1])
    if 0 < settings.kept_bytes_per_key < floor[1]:
        raise ConfigError(f"kept_bytes_per_key must be 0 (no quota) or at least {floor[0]} "
                          f"({floor[1]}), so that any request fits, got "
                          f"{settings.kept_bytes_per_key}")
    if not settings.read_rate_per_key >= 0:  # NaN too
        raise ConfigError(f"read_rate_per_key must be >= 0, got {settings.read_rate_per_key}")
    if settings.read_rate_per_key > 0 and settings.read_burst_per_key < 1:
        raise ConfigError("read_burst_per_key must be an integer >= 1 with a read_rate_per_key, "
                          f"got {settings.read_burst_per_key}")
    if settings.webhook_host_concurrency < 1:
        raise ConfigError("webhook_host_concurrency must be an integer >= 1, "
                          f"got {settings.webhook_host_concurrency}")
    if settings.webhook_timeout_s <= 0:
        raise ConfigError(f"webhook_timeout_s must be > 0, got {settings.webhook_timeout_s}")
    if settings.body_timeout_s <= 0:
        raise ConfigError(f"body_timeout_s must be > 0, got {settings.body_timeout_s}")
    for entry in filter(None, (e.strip() for e in settings.forwarded_allow_ips.split(","))):
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise ConfigError("forwarded_allow_ips must list IP addresses or CIDRs, got "
                              f"{entry!r}") from None


def _check_images(settings: Settings) -> None:
    """The image fetching and decoding limits."""
    if settings.image_decoders < 1:
        raise ConfigError(f"image_decoders must be an integer >= 1, got {settings.image_decoders}")
    if not 0 <= settings.image_decoders_per_key <= settings.image_decoders:
        raise ConfigError("image_decoders_per_key must be 0 (half the decoders) to "
                          f"image_decoders ({settings.image_decoders}), got "
                          f"{settings.image_decoders_per_key}")
    for name in ("image_decode_timeout_s", "image_decode_budget_s", "image_fetch_deadline_s"):
        if getattr(settings, name) <= 0:
            raise ConfigError(f"{name} must be > 0, got {getattr(settings, name)}")
    if settings.image_decode_memory_mb < 256:
        raise ConfigError("image_decode_memory_mb must be an integer >= 256, got "
                          f"{settings.image_decode_memory_mb}")


def _check_workers(settings: Settings) -> None:
    """The workers' isolation and stop limits."""
    if settings.max_job_crashes < 1:
        raise ConfigError(f"max_job_crashes must be an integer >= 1, got "
                          f"{settings.max_job_crashes}")
    if settings.stop_timeout_s <= 0:
        raise ConfigError(f"stop_timeout_s must be > 0, got {settings.stop_timeout_s}")
    if not 1 <= settings.children_per_gpu <= 8:
        raise ConfigError(f"children_per_gpu must be an integer from 1 to 8, got "
                          f"{settings.children_per_gpu}")
    if settings.max_batch_tokens < 1:
        raise ConfigError(f"max_batch_tokens must be an integer >= 1, got "
                          f"{settings.max_batch_tokens}")
    if not 0 <= settings.batches_ahead <= 4:
        raise ConfigError(f"batches_ahead must be an integer from 0 to 4, got "
                          f"{settings.batches_ahead}")
    # Below 0 Celery's QoS admits no message (the worker fetches nothing, its jobs wait
    # forever); past kombu's PREFETCH_COUNT_MAX it is switched off (the worker takes all).
    if not 0 <= settings.prefetch_multiplier <= PREFETCH_COUNT_MAX:
        raise ConfigError(f"prefetch_multiplier must be an integer from 0 (two full batches of "
                          f"the largest model a worker serves) to {PREFETCH_COUNT_MAX}, got "
                          f"{settings.prefetch_multiplier}")


# The longest path a Unix socket's address holds (sun_path: 108 bytes, its NUL included).
SOCKET_PATH_MAX = 107


def check_socket_url(name: str, url: str) -> None:
    """A `unix://[user:password@]/absolute/path[?db=N]` URL (redis-py's spelling), or
    ConfigError naming `name` and the URL (its password hidden). Any other URL passes."""
    parts = urlsplit(url)
    if parts.scheme != "unix":
        return
    query = parse_qsl(parts.query, keep_blank_values=True)
    path = parts.path
    if parts.hostname or not path.startswith("/") or path.endswith("/") or \
            len(os.fsencode(path)) > SOCKET_PATH_MAX or \
            any(key != "db" or not value.isdigit() for key, value in query):
        raise ConfigError(f"{name} must be unix:///absolute/path/to/redis.sock[?db=N] (a path "
                          f"of at most {SOCKET_PATH_MAX} bytes), got {shown_url(url)!r}")


def shown_url(url: str) -> str:
    """The URL with its password hidden (in errors and in Settings.__repr__)."""
    parts = urlsplit(url)
    if parts.password:
        user = parts.username or ""
        return parts._replace(netloc=f"{user}:**@{parts.netloc.rsplit('@', 1)[1]}").geturl()
    return url


def _check_redis(settings: Settings) -> None:
    """The Redis URL, the deadline, the sentinels and the replicas a submit waits for."""
    check_socket_url("redis_url", settings.redis_url)
    if settings.sentinel_hosts and settings.redis_url.startswith("unix://"):
        raise ConfigError("redis_url must be a redis:// or rediss:// URL with redis_sentinels "
                          "(the sentinels name the primary's host), got a unix:// socket")
    if settings.redis_deadline_s <= 0:
        raise ConfigError(f"redis_deadline_s must be > 0, got {settings.redis_deadline_s}")
    if settings.sentinel_hosts and not settings.redis_master:
        raise ConfigError("redis_master must name the primary the sentinels watch, got ''")
    if settings.redis_wait_replicas < -1:
        raise ConfigError("redis_wait_replicas must be an integer >= -1 (-1: 1 with Sentinel), "
                          f"got {settings.redis_wait_replicas}")
    if settings.wait_replicas and not \
            0 < settings.redis_wait_timeout_s < settings.redis_deadline_s:
        raise ConfigError("redis_wait_timeout_s must be > 0 and below redis_deadline_s "
                          f"({settings.redis_deadline_s:g}), got {settings.redis_wait_timeout_s}")
