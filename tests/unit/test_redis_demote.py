"""scripts/redis-demote.sh, Sentinel's client-reconfig-script, when its settings are missing:
exit status 2 (Sentinel logs it and does not run it again), never 1 (run again, up to 10
times), and a line that names what is missing. The demotion itself: tests/faults."""
from __future__ import annotations

import os
import subprocess

import pytest

from scripts.processes import ROOT

ARGS = ["mymaster", "leader", "start", "127.0.0.1", "1", "127.0.0.1", "2"]


def demote(env: dict[str, str], args: list[str] = ARGS) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in ("IQ_REDIS_PASSWORD_FILE", "REDIS_PORT")}
    return subprocess.run(["bash", str(ROOT / "scripts" / "redis-demote.sh"), *args],
                          env={**base, **env}, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("case", ["no password file", "a password file that is not there",
                                  "no sentinel port"])
def test_missing_settings_exit_2_naming_them(tmp_path, case):
    secret = tmp_path / "redis-password"
    secret.write_text("s3cret\n")
    env = {"no password file": {"REDIS_PORT": "26379"},
           "a password file that is not there": {"IQ_REDIS_PASSWORD_FILE": str(tmp_path / "gone"),
                                                 "REDIS_PORT": "26379"},
           "no sentinel port": {"IQ_REDIS_PASSWORD_FILE": str(secret)}}[case]
    done = demote(env)
    assert done.returncode == 2, done.stderr
    assert "IQ_REDIS_PASSWORD_FILE" in done.stderr and "REDIS_PORT" in done.stderr
    assert "s3cret" not in done.stderr + done.stdout


@pytest.mark.parametrize("at, value", [(3, "127.0.0.1\nFLUSHALL"), (5, "127.0.0.1 6379"),
                                       (4, "1\nCONFIG SET dir /"), (6, "2 x")])
def test_an_address_that_is_not_one_stops_it_before_any_command(tmp_path, at, value):
    """A line break or a space in a host or port would add commands or words to what the
    script pipes to redis-cli: it exits 2 naming the value, and contacts nothing."""
    secret = tmp_path / "redis-password"
    secret.write_text("s3cret\n")
    args = list(ARGS)
    args[at] = value
    done = demote({"IQ_REDIS_PASSWORD_FILE": str(secret), "REDIS_PORT": "1"}, args)
    assert done.returncode == 2, done.stderr
    assert f"'{value}' is not a" in done.stderr
    assert "sentinel names" not in done.stderr  # it asked no sentinel
