"""`make run`'s own Redis, replicated: with REDIS_REPLICAS=N (N >= 1), a primary and N replicas
on REDIS_PORT and the ports after it, and three Redis Sentinels (quorum 2) on
REDIS_SENTINEL_PORT (26379) and the two after it, each a process of its own under honcho
(scripts/redis-server.sh), and every process of the application pointed at the sentinels.

Which node is the primary is the sentinels' to say: after a failover they write the new one
into their configuration file, and the next `make run` starts that node as the primary and
the others as its replicas, so that a restart never has the newest data resynced away. The
first run starts REDIS_PORT's node as the primary.
"""
from __future__ import annotations

import re
from pathlib import Path

from config import ConfigError, Settings
from scripts.preflight import REDIS_APP_USER, Binding

SENTINELS = 3


def replicas(env: dict[str, str]) -> int:
    raw = env.get("REDIS_REPLICAS") or "0"
    if not raw.isdigit():
        raise ConfigError(f"REDIS_REPLICAS must be a number of replicas (0: none), "
                      f"got {raw!r}")
    return int(raw)


def min_replicas_to_write(env: dict[str, str]) -> str:
    """REDIS_MIN_REPLICAS_TO_WRITE: 1 by default with replicas, 0 (a primary writes without
    any replica) without; never more than there are replicas, or no write is ever taken."""
    raw = env.get("REDIS_MIN_REPLICAS_TO_WRITE") or ("1" if replicas(env) else "0")
    if not raw.isdigit() or int(raw) > replicas(env):
        raise ConfigError(f"REDIS_MIN_REPLICAS_TO_WRITE must be a number of replicas from 0 "
                          f"to REDIS_REPLICAS ({replicas(env)}), got {raw!r}")
    return raw


def _node_ports(env: dict[str, str], redis_port: int) -> list[int]:
    return [redis_port + i for i in range(replicas(env) + 1)]


def _sentinel_ports(env: dict[str, str]) -> list[int]:
    raw = env.get("REDIS_SENTINEL_PORT") or "26379"
    if not raw.isdigit() or int(raw) + SENTINELS - 1 > 65535:
        raise ConfigError(f"REDIS_SENTINEL_PORT must be a port number (0-65533), "
                      f"got {raw!r}")
    return [int(raw) + i for i in range(SENTINELS)]


def bindings(env: dict[str, str], redis_port: int) -> list[Binding]:
    """The replicas' and sentinels' ports, for the port check (none without replicas)."""
    if not replicas(env):
        return []
    return [*(Binding(f"Redis replica {i}", "REDIS_PORT", "127.0.0.1", port)
              for i, port in enumerate(_node_ports(env, redis_port)[1:], 1)),
            *(Binding(f"Redis Sentinel {i}", "REDIS_SENTINEL_PORT", "127.0.0.1", port)
              for i, port in enumerate(_sentinel_ports(env), 1))]


def _data_dir(var_dir: Path, port: int, redis_port: int) -> Path:
    return var_dir / ("redis" if port == redis_port else f"redis-{port}")


def primary_port(var_dir: Path, nodes: list[int], master: str) -> int:
    """The node the sentinels named the primary last (their configuration file), else the
    first."""
    for path in sorted(var_dir.glob("sentinel-*/sentinel.conf")):
        found = re.search(rf"^sentinel monitor {re.escape(master)} \S+ (\d+) ",
                          path.read_text(errors="replace"), re.M)
        if found and int(found.group(1)) in nodes:
            return int(found.group(1))
    return nodes[0]


def processes(env: dict[str, str], var_dir: Path, redis_port: int) -> dict[str, dict[str, str]]:
    """Each Redis process beside the Procfile's `redis` (and `redis` itself): its name and
    what it adds to the environment scripts/redis-server.sh starts with."""
    nodes = _node_ports(env, redis_port)
    master = env.get("IQ_REDIS_MASTER") or Settings.redis_master
    primary = primary_port(var_dir, nodes, master)
    fsync = env.get("REDIS_APPENDFSYNC") or "everysec"
    # Whichever node is the primary refuses writes without a replica in sync (every node gets
    # it: any may be promoted): after a failover, the old primary's clients are refused at
    # once rather than their writes discarded when it turns replica (scripts/redis-server.sh).
    min_replicas = min_replicas_to_write(env)
    out: dict[str, dict[str, str]] = {}
    for port in nodes:
        name = "redis" if port == redis_port else f"redis-{port}"
        # A job is on a replica before its 202 (WAIT): a crash of one host loses none of
        # them without an fsync per write.
        out[name] = {"REDIS_PORT": str(port), "REDIS_APPENDFSYNC": fsync,
                     "IQ_REDIS_DIR": str(_data_dir(var_dir, port, redis_port)),
                     "REDIS_MIN_REPLICAS_TO_WRITE": min_replicas}
        if port != primary:
            out[name]["REDIS_REPLICA_OF"] = f"127.0.0.1:{primary}"
    for i, port in enumerate(_sentinel_ports(env), 1):
        out[f"sentinel-{i}"] = {"REDIS_PORT": str(port), "IQ_REDIS_MASTER": master,
                                "IQ_REDIS_DIR": str(var_dir / f"sentinel-{port}"),
                                "REDIS_SENTINEL_MONITOR": f"127.0.0.1:{primary}"}
    return out


def application_env(env: dict[str, str], app_password: str) -> dict[str, str]:
    """What points the application's processes at the sentinels, as the application's user
    (on the sentinels it may only ask where the primary is)."""
    return {"IQ_REDIS_SENTINELS": ",".join(f"127.0.0.1:{p}" for p in _sentinel_ports(env)),
            "IQ_REDIS_SENTINEL_USER": REDIS_APP_USER,
            "IQ_REDIS_SENTINEL_PASSWORD": app_password}


def described(env: dict[str, str], redis_port: int, var_dir: Path) -> str:
    """The block's words for it: which node is the primary, which are replicas, the
    sentinels."""
    nodes = _node_ports(env, redis_port)
    master = env.get("IQ_REDIS_MASTER") or Settings.redis_master
    primary = primary_port(var_dir, nodes, master)
    others = ", ".join(str(p) for p in nodes if p != primary)
    sentinels = _sentinel_ports(env)
    return (f"primary on {primary}, replica(s) on {others}, sentinels on "
            f"{sentinels[0]}-{sentinels[-1]} (master {master})")
