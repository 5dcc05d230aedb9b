"""What docs/security.md (Known limits) says of a deleted job's inputs on disk, on Redis as
`make run` starts it (scripts/redis-server.sh: append-only, Redis's own rewrite schedule):
deleted from memory, they stay in the append-only file until it is rewritten; the application's
user may not rewrite it, the admin's `BGREWRITEAOF` does, and the new file lacks them."""
from __future__ import annotations

import secrets

import pytest
import redis

from scripts.stack import start_redis, wait_until


@pytest.fixture
def server(tmp_path):
    svc = start_redis(tmp_path, appendonly=True)
    yield svc
    svc.stop()


def test_a_deleted_jobs_inputs_stay_in_the_aof_until_the_admin_rewrites_it(server, tmp_path):
    app = redis.Redis.from_url(server.extra["url"])
    admin = redis.Redis.from_url(server.extra["admin_url"], decode_responses=True)
    aof = next(tmp_path.rglob("appendonly.aof"))
    marker = f"input-{secrets.token_hex(8)}"
    app.hset("iq:job:deleted", mapping={"request": marker})  # as a job record keeps a request
    app.delete("iq:job:deleted")  # DELETE /v1/jobs/<id>
    assert app.exists("iq:job:deleted") == 0
    assert marker.encode() in aof.read_bytes()  # gone from memory, not from the disk
    # Redis rewrites by itself only once the file has doubled and is 64 MB (the defaults).
    assert admin.config_get("auto-aof-rewrite-*") == {"auto-aof-rewrite-percentage": "100",
                                                      "auto-aof-rewrite-min-size": "67108864"}
    with pytest.raises(redis.exceptions.NoPermissionError):
        app.bgrewriteaof()
    admin.bgrewriteaof()
    wait_until(lambda: admin.info("persistence")["aof_rewrite_in_progress"] == 0
               and marker.encode() not in aof.read_bytes(), 30, "the rewrite")
    assert admin.info("persistence")["aof_last_bgrewrite_status"] == "ok"
