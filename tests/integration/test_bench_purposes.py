"""bench.purposes reads a real Redis's MONITOR stream and gives every command of a job one
purpose, counting a script's own commands as INFO commandstats counts them."""
from pathlib import Path

import redis

from bench.purposes import Monitor, Tally, script_names
from scripts.stack import start_redis, wait_until
from tasks import job_lua

ROOT = Path(__file__).resolve().parents[2]


def test_a_scripts_commands_take_its_purpose_and_match_commandstats(tmp_path):
    server = start_redis(tmp_path)
    try:
        admin = redis.Redis.from_url(server.extra["admin_url"])
        app = redis.Redis.from_url(server.extra["url"])
        finish = app.register_script(job_lua.FINISH)
        app.hset("iq:job:j1", mapping={"status": "running"})
        app.script_load(job_lua.FINISH)
        major = int(admin.info("server")["redis_version"].split(".")[0])
        before = {k: v["calls"] for k, v in admin.info("commandstats").items()}
        monitor = Monitor(server.extra["admin_url"])
        # KEYS: record, result, the pending set. ARGV: keep_s, ttl_s, finished_at, result
        # ttl, model version, then the job's status, result, error, webhook list, message and
        # wake-up list, token, webhook delivery id.
        finish(keys=["iq:job:j1", "celery-task-meta-j1", "iq:pending"],
               args=[0, 60, "1", 60, "v1", "succeeded", "{}", "", "", "", "", "", ""])
        with app.pipeline(transaction=True) as pipe:  # MULTI, ZREM, HDEL, EXEC
            pipe.zrem("unacked_index", "tag").hdel("unacked", "tag").execute()
        app.publish("/0.celeryev/task.multi", "{}")
        app.ping()  # the last command: once MONITOR shows it, it has shown the rest
        wait_until(lambda: b'"ping"' in b"".join(monitor.chunks).lower(), 5,
                   "the PING in MONITOR")
        lines = monitor.stop()
        after = {k.removeprefix("cmdstat_"): v["calls"]
                 for k, v in admin.info("commandstats").items()}
    finally:
        server.stop()
    tally = Tally(script_names(ROOT))
    tally.feed(lines, scripts_first=major < 7)
    # FINISH: EVALSHA, TIME, HMGET, HSTRLEN (its kept request's size), DEL, HSET (its model
    # version in it), EXPIRE, SET, ZREM (result), PUBLISH "done j1" on iq:moves (wake-up).
    assert tally.commands["result"] == 9
    assert tally.round_trips["result"] == 1
    assert tally.commands["wake-up"] == 1 and tally.jobs_finished == 1
    assert tally.commands["ack"] == 4  # MULTI, ZREM, HDEL, EXEC
    assert tally.commands["events"] == 1
    assert not tally.unknown_scripts
    # Each command as many times as Redis's own count says it ran (inside the script too).
    for command, calls in tally.by_command.items():
        assert after[command] - before.get(f"cmdstat_{command}", 0) == calls, command
    assert tally.by_command["hset"] == 1 and tally.by_command["evalsha"] == 1
