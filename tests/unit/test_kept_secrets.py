"""`make run` keeps its secrets under IQ_VAR_DIR only when this user made them
(scripts/var_dir.py): a secret file or folder another user prepared, or a link, is refused by name
before anything starts, so that nobody else chooses (or reads) the webhook key or the Redis
passwords."""
from __future__ import annotations

import os
import pwd
import stat
import subprocess

import pytest

from scripts.preflight import Refused
from scripts.stack import ROOT
from scripts.var_dir import kept_secret, var_problems

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a file away needs root")
NOBODY = pwd.getpwnam("nobody")


def give_away(*paths) -> None:
    for path in paths:
        os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid, follow_symlinks=False)


def test_a_secret_is_made_private_and_kept(tmp_path):
    var = tmp_path / "var"
    value, path = kept_secret(var, "webhook-secret")
    assert kept_secret(var, "webhook-secret") == (value, path)
    path.chmod(0o644)
    (var / "secrets").chmod(0o755)
    assert kept_secret(var, "webhook-secret")[0] == value
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert {stat.S_IMODE(p.stat().st_mode) for p in (var, var / "secrets")} == {0o700}
    assert var_problems(var) == []


@needs_root
@pytest.mark.parametrize("prepared", ["file", "folder", "var"])
def test_a_secret_another_user_prepared_is_refused(tmp_path, prepared):
    var = tmp_path / "var"
    (var / "secrets").mkdir(parents=True, mode=0o777)
    chosen = var / "secrets" / "webhook-secret"
    chosen.write_text("attacker-chosen-secret\n")
    give_away(*{"file": [chosen], "folder": [var / "secrets"], "var": [var]}[prepared])
    at_fault = {"file": chosen, "folder": var / "secrets", "var": var}[prepared]
    (problem,) = var_problems(var)
    assert f"{at_fault} is owned by uid {NOBODY.pw_uid}, not by you" in problem
    with pytest.raises(Refused, match=f"{at_fault} is owned by uid {NOBODY.pw_uid}"):
        kept_secret(var, "webhook-secret")


def test_a_secret_that_is_a_link_is_refused(tmp_path):
    var = tmp_path / "var"
    (var / "secrets").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("someone-elses-secret\n")
    (var / "secrets" / "redis-password").symlink_to(elsewhere)
    assert "redis-password is a symbolic link" in " ".join(var_problems(var))
    with pytest.raises(Refused, match="redis-password is a symbolic link"):
        kept_secret(var, "redis-password")


@needs_root
def test_redis_data_another_user_prepared_is_refused(tmp_path):
    aof = tmp_path / "var" / "redis" / "appendonly.aof"
    aof.parent.mkdir(parents=True)
    aof.write_text("*1\r\n$8\r\nFLUSHALL\r\n")
    give_away(aof)
    (problem,) = var_problems(tmp_path / "var")
    assert f"{aof} is owned by uid {NOBODY.pw_uid}" in problem


@needs_root
@pytest.mark.parametrize("folder", ["sentinel-26379", "redis-6380"])
def test_a_sentinels_or_replicas_files_another_user_prepared_are_refused(tmp_path, folder):
    """A sentinel's configuration names the primary make run starts (and holds the
    passwords); a replica's data is Redis's data."""
    planted = tmp_path / "var" / folder / ("sentinel.conf" if "sentinel" in folder
                                           else "appendonly.aof")
    planted.parent.mkdir(parents=True)
    planted.write_text("sentinel monitor mymaster 127.0.0.1 6380 2\n")
    give_away(planted)
    (problem,) = var_problems(tmp_path / "var")
    assert f"{planted} is owned by uid {NOBODY.pw_uid}" in problem


@needs_root
def test_make_run_stops_before_starting_anything(tmp_path):
    var = tmp_path / "var"
    (var / "secrets").mkdir(parents=True)
    (var / "secrets" / "webhook-secret").write_text("attacker-chosen-secret\n")
    give_away(var / "secrets" / "webhook-secret")
    env = {k: v for k, v in os.environ.items()
           if k not in ("REDIS_URL", "IQ_MODELS_FILE", "IQ_WEBHOOK_SECRET")}
    done = subprocess.run([str(ROOT / "scripts" / "run.sh")], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=dict(env, IQ_VAR_DIR=str(var)))
    assert done.returncode != 0
    assert f"make run: {var}/secrets/webhook-secret is owned by uid {NOBODY.pw_uid}" \
        in done.stderr
    assert sorted(p.name for p in var.rglob("*")) == ["secrets", "webhook-secret"]


@pytest.mark.parametrize("mode, refused", [(0o777, True), (0o1777, False), (0o755, False)])
def test_a_folder_above_the_var_dir_others_may_write_is_refused(tmp_path, mode, refused):
    """The re-attack on issue 26 (F9's note): whoever may write the folder above IQ_VAR_DIR
    may rename var/ away and put theirs in its place; a sticky one (/tmp) does not let them."""
    above = tmp_path / "srv"
    above.mkdir()
    above.chmod(mode)
    var = above / "var"
    kept_secret(var, "webhook-secret")
    problems = [p for p in var_problems(var) if p.startswith(f"make run: {above} ")]
    assert bool(problems) is refused, problems
    if refused:
        assert f"make run: {above} is writable by everyone (mode 0777): another user may put " \
            f"a folder of theirs in place of {var}" in problems[0]
