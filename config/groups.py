"""Redis groups: more Redis servers behind one API, for when one Redis is the limit.

`redis_groups` (IQ_REDIS_GROUPS: `name=url,name=url`; in the YAML settings file a mapping of
name to URL as well) names the extra servers; a model's entry in the models file names its
group (`redis: <name>`), and its queue, its jobs' records and results live on that group's
Redis only. A model that names none stays on REDIS_URL (the default group, named "").
A job's id names its group (config/job_ids.py). Nothing here imports Flask or torch."""
from __future__ import annotations

import re
from typing import Any, Mapping
from urllib.parse import urlsplit

from config.checks import ConfigError, check_socket_url, shown_url
from config.job_ids import group_tag

GROUP_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
URL_SCHEMES = ("redis", "rediss", "unix")


def groups_text(raw: Any) -> str:
    """The setting as IQ_REDIS_GROUPS writes it, from the YAML file's mapping (or string)."""
    if isinstance(raw, Mapping):
        return ",".join(f"{name}={url}" for name, url in raw.items())
    if not isinstance(raw, str):
        raise ConfigError(f"redis_groups must be a mapping of name to Redis URL (or "
                          f"name=url,name=url), got {raw!r}")
    return raw


def parse_groups(text: str) -> dict[str, str]:
    """redis_groups as {name: url}; ConfigError naming the entry at fault."""
    groups: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, sep, url = (part.strip() for part in entry.partition("="))
        if not sep or not name or not url:
            raise ConfigError(f"redis_groups must list name=url entries, comma-separated, "
                              f"got {entry!r}")
        if not GROUP_NAME.match(name):
            raise ConfigError(f"redis_groups: a group name is a lower-case letter, then up to "
                              f"31 lower-case letters, digits or _; got {name!r}")
        if urlsplit(url).scheme not in URL_SCHEMES:
            raise ConfigError(f"redis_groups.{name} must be a redis://, rediss:// or unix:// "
                              f"URL, got {shown_url(url)!r}")
        check_socket_url(f"redis_groups.{name}", url)
        if name in groups:
            raise ConfigError(f"redis_groups: group {name!r} is named twice")
        if url in groups.values():
            raise ConfigError(f"redis_groups.{name}: {shown_url(url)!r} is already the Redis "
                              f"of another group: each group has a Redis of its own")
        groups[name] = url
    tags = {group_tag(name): name for name in groups}
    if len(tags) != len(groups):  # eight hex digits of a hash: never seen, still checked
        raise ConfigError(f"redis_groups: two group names share a tag, rename one: "
                          f"{', '.join(sorted(groups))}")
    return groups


def shown_groups(text: str) -> str:
    """redis_groups as Settings.__repr__ shows it: every password hidden."""
    return ",".join(f"{name}={shown_url(url)}" if sep else entry
                    for entry in filter(None, (e.strip() for e in text.split(",")))
                    for name, sep, url in [entry.partition("=")])


def check_model_groups(models: Mapping[str, Any], groups: Mapping[str, str]) -> None:
    """ConfigError for the first model whose `redis` names no configured group."""
    for name, spec in models.items():
        if spec.redis and spec.redis not in groups:
            known = ", ".join(sorted(groups)) or "none is configured"
            raise ConfigError(f"models.{name}: redis must name a group of redis_groups "
                              f"({known}), got {spec.redis!r}")
