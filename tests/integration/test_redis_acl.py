"""The application's Redis user (scripts/redis-server.sh, as `make run` and every test stack start
Redis): it runs the job scripts, and nothing of SCRIPT or MEMORY beyond what loading them
needs. An endless script is inherent to EVAL (Redis 6.2): the admin's SCRIPT KILL ends one
that has not written (docs/security.md)."""
from __future__ import annotations

import threading

import pytest
import redis

from scripts.stack import wait_until


@pytest.fixture
def app(redis_server) -> redis.Redis:
    return redis.Redis.from_url(redis_server.extra["url"])


@pytest.fixture
def admin(redis_server) -> redis.Redis:
    return redis.Redis.from_url(redis_server.extra["admin_url"])


def test_the_app_user_runs_scripts_as_redis_py_does(app):
    script = app.register_script("return redis.call('incr', KEYS[1])")
    app.delete("iq:acl:count")
    assert script(keys=["iq:acl:count"]) == 1  # EVALSHA, NOSCRIPT, SCRIPT LOAD, EVALSHA
    assert app.script_exists(script.sha) == [True]
    with app.pipeline() as pipe:
        script(keys=["iq:acl:count"], client=pipe)
        assert pipe.execute() == [2]  # a pipeline checks SCRIPT EXISTS first


@pytest.mark.parametrize("command", [("SCRIPT", "FLUSH"), ("SCRIPT", "KILL"),
                                     ("SCRIPT", "DEBUG", "YES"), ("MEMORY", "PURGE"),
                                     ("MEMORY", "DOCTOR")])
def test_the_app_user_may_not_flush_kill_or_debug_scripts_nor_purge_memory(app, command):
    with pytest.raises(redis.exceptions.NoPermissionError):
        app.execute_command(*command)


def test_an_endless_script_of_the_app_user_is_killed_by_the_admin(redis_server, app, admin):
    outcome: list[str] = []
    # redis-py reads an answer for 5 s at most, as long as Redis takes to answer others BUSY:
    # on a loaded machine the kill comes later, so the script's own client waits longer.
    patient = redis.Redis.from_url(redis_server.extra["url"], socket_timeout=60)

    def endless() -> None:
        try:
            patient.eval("while true do end", 0)
        except redis.exceptions.ResponseError as exc:
            outcome.append(str(exc))

    runner = threading.Thread(target=endless)
    runner.start()
    other = redis.Redis.from_url(redis_server.extra["url"])  # the app user, another client
    try:
        # Redis answers others (BUSY) once the script has run lua-time-limit (5 s).
        def busy() -> bool:
            try:
                other.ping()
            except redis.exceptions.ResponseError as exc:
                return "BUSY" in str(exc)
            return False

        wait_until(busy, 30, "Redis to answer BUSY")
        with pytest.raises(redis.exceptions.ResponseError):
            other.script_kill()  # the app's own user may not
        admin.script_kill()
    finally:
        runner.join(30)
    assert outcome and "killed" in outcome[0].lower(), outcome
    assert app.ping()
