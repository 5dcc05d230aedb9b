"""Service settings, layered: defaults in this file → a YAML file → environment variables.

The API, the workers and the scripts all read the same `Settings`, so a value set once (say
`REDIS_URL`) reaches every process. Nothing here imports torch or Flask.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

import yaml

CONFIG_DIR = Path(__file__).resolve().parent
PROJECT_DIR = CONFIG_DIR.parent


class ConfigError(ValueError):
    """A setting or a model declaration is wrong; the message names it."""


@dataclass(frozen=True)
class Settings:
    # Redis is the broker and the result backend unless told otherwise.
    redis_url: str = "redis://127.0.0.1:6379/0"
    broker_url: str = ""
    result_backend: str = ""
    models_file: str = str(CONFIG_DIR / "models.yaml")

    # Access layer.
    max_body_bytes: int = 1_048_576
    max_wait_s: float = 30.0
    redis_timeout_s: float = 2.0
    job_ttl_s: int = 86_400
    api_keys_file: str = ""  # YAML of hashed API keys; none: the API is open

    # Webhooks. Hosts (or CIDRs) allowed even though they are private/loopback/link-local.
    webhook_allow: str = ""
    webhook_secret: str = "change-me"
    webhook_retries: int = 8
    webhook_backoff_s: float = 2.0
    webhook_timeout_s: float = 10.0

    # Image URLs (app/image_urls.py): hosts (or CIDRs) the API may fetch images from although
    # they are not public, and one deadline for each fetch.
    image_url_allow: str = ""
    image_fetch_deadline_s: float = 10.0

    # Workers.
    heartbeat_interval_s: float = 2.0
    heartbeat_ttl_s: float = 10.0
    # Model loading and warm-up run inside the pool child before it reports ready; Celery's
    # default of 4 s would kill a child that is still loading a large model.
    proc_alive_timeout_s: float = 300.0
    # Redis redelivers an unacknowledged message after this long when the whole worker died
    # (a lost pool child is redelivered at once). It must exceed the longest batch.
    visibility_timeout_s: int = 3600
    # A pool child that died mid-batch is noticed after this long.
    worker_lost_wait_s: float = 1.0
    # Messages a worker holds unacknowledged per child; 0: two full batches of the largest
    # model, enough to fill a batch while every child is busy.
    prefetch_multiplier: int = 0
    cpu_threads: int = 0  # 0: torch's default
    cuda_alloc_conf: str = "expandable_segments:True"
    cuda_memory_fraction: float = 0.0  # 0: no cap

    log_level: str = "INFO"

    @property
    def broker(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def backend(self) -> str:
        return self.result_backend or self.redis_url

    @property
    def webhook_allow_list(self) -> list[str]:
        return [h.strip() for h in self.webhook_allow.split(",") if h.strip()]

    @property
    def image_url_allow_list(self) -> list[str]:
        return [h.strip() for h in self.image_url_allow.split(",") if h.strip()]


# Environment variable → field. REDIS_URL is the one name every Redis user already knows; the
# rest carry the IQ_ prefix so they cannot collide with other software's.
ENV_NAMES: dict[str, str] = {"REDIS_URL": "redis_url"}
ENV_NAMES.update({f"IQ_{f.name.upper()}": f.name for f in fields(Settings)})


def _coerce(name: str, raw: Any, kind: type) -> Any:
    try:
        if kind is bool:
            return str(raw).lower() in {"1", "true", "yes", "on"}
        return kind(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be {kind.__name__}, got {raw!r}") from None


def load_settings(
    overrides: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Build Settings: defaults, then the YAML file named by IQ_CONFIG (if any), then the
    environment, then `overrides` (tests pass theirs here)."""
    environ = os.environ if environ is None else environ
    types = {f.name: type(f.default) for f in fields(Settings)}
    values: dict[str, Any] = {}

    config_file = environ.get("IQ_CONFIG")
    if config_file:
        data = yaml.safe_load(Path(config_file).read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{config_file}: expected a mapping at the top level")
        for key, raw in data.items():
            if key not in types:
                raise ConfigError(f"{config_file}: unknown setting {key!r}")
            values[key] = _coerce(key, raw, types[key])

    for env_name, key in ENV_NAMES.items():
        if env_name in environ and environ[env_name] != "":
            values[key] = _coerce(env_name, environ[env_name], types[key])

    for key, raw in (overrides or {}).items():
        if key not in types:
            raise ConfigError(f"unknown setting {key!r}")
        values[key] = _coerce(key, raw, types[key])

    settings = dataclasses.replace(Settings(), **values)
    if settings.max_wait_s <= 0 or settings.max_wait_s > 300:
        raise ConfigError(f"max_wait_s must be in (0, 300], got {settings.max_wait_s}")
    return settings
