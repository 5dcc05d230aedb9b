"""The operator's files are safe from other local users (issue 37, "operator files safe"):
`make reload` writes nothing through a link another user planted in a sticky folder (/tmp) under
a name it uses (its staging file, `<name>.previous`, the models file itself), keeps the models
file's mode and owner, and the settings file (IQ_CONFIG) and the API keys file are checked as
the models file is, by `make run` and `make reload`, each refused in one line naming it.

Links and files "of another user" are given to `nobody` (the tests run as root, as the issue's
attack did; without root they are skipped)."""
from __future__ import annotations

import os
import pwd
import signal
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from config import Settings
from scripts.preflight import operator_file_problems, writable_by_others
from scripts.reload import INVALID, Invalid, install, reload
from scripts.stack import ROOT, free_port

PORTS = ("REDIS_PORT", "IQ_PORT", "FLOWER_PORT", "IQ_WORKER_METRICS_PORT",
         "IQ_WEBHOOK_METRICS_PORT")

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a file away needs root")
NOBODY = pwd.getpwnam("nobody")
GOOD = {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}
NEW = {"quick": {**GOOD["quick"], "version": "2"}}


@pytest.fixture
def sticky(tmp_path) -> Path:
    """A folder anyone may add to, as /tmp: the models file the operator keeps there (0600),
    the file to install (0644) in a private folder, and a victim file of the operator's."""
    tmp_path.chmod(0o755)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    models = shared / "models.yaml"
    models.write_text(yaml.safe_dump({"models": GOOD}))
    models.chmod(0o600)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (mine / "new.yaml").write_text(yaml.safe_dump({"models": NEW}))
    (mine / "new.yaml").chmod(0o644)
    (mine / "victim").write_text("the operator's own file\n")
    return shared


def plant(link: Path, to: Path) -> None:
    """A link another user made (lchown: the link, not what it points to)."""
    link.symlink_to(to)
    os.lchown(link, NOBODY.pw_uid, NOBODY.pw_gid)


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry of `folder` and what it is: a link's target, a file's bytes and mode."""
    return {p.name: (os.readlink(p),) if p.is_symlink() else
            (p.read_bytes(), stat.S_IMODE(p.stat().st_mode)) for p in folder.iterdir()}


@needs_root
def test_a_link_planted_as_the_staging_name_is_never_written_through(sticky):
    """The staging file was `.models.yaml.<pid>`, a name anyone can guess: a link planted
    there got the new file written to where it points (here the operator's own file), and
    was then renamed into place as the models file (what it points to is the attacker's to
    change after the check). Staged under a fresh random name now, never through a link."""
    mine = sticky.parent / "mine"
    planted = sticky / f".models.yaml.{os.getpid()}"
    plant(planted, mine / "victim")
    install(sticky / "models.yaml", mine / "new.yaml")
    assert (mine / "victim").read_text() == "the operator's own file\n"
    assert os.readlink(planted) == str(mine / "victim")
    installed = sticky / "models.yaml"
    assert not installed.is_symlink()
    assert yaml.safe_load(installed.read_text())["models"] == NEW
    assert not [p for p in sticky.iterdir() if p.name.endswith(".staged")]


@needs_root
def test_a_link_planted_as_previous_is_refused_and_nothing_changes(sticky):
    """The copy of the file replaced went through a link at `models.yaml.previous`: it wrote
    the old models file over whatever the link's owner chose."""
    mine = sticky.parent / "mine"
    plant(sticky / "models.yaml.previous", mine / "victim")
    before, victim = snapshot(sticky), (mine / "victim").read_bytes()
    with pytest.raises(Invalid) as refused:
        install(sticky / "models.yaml", mine / "new.yaml")
    assert f"{sticky}/models.yaml.previous: a link owned by another user, nobody " \
           f"(uid {NOBODY.pw_uid})" in str(refused.value)
    assert snapshot(sticky) == before and (mine / "victim").read_bytes() == victim


@needs_root
@pytest.mark.parametrize("source", ["FILE", "the file in place"])
def test_a_link_planted_as_the_models_file_is_refused_and_nothing_changes(sticky, source):
    """Another user's link in place of the models file (its name free for a moment in a
    sticky folder, or never taken), pointing at a private file that passes every other
    check: the old check passed it (a link's owner was never looked at), so a reload
    installed it or reloaded through it, and the next pool child loaded what it pointed to."""
    mine = sticky.parent / "mine"
    theirs = mine / "theirs.yaml"  # private and root's: only the link is another user's
    theirs.write_text(yaml.safe_dump({"models": {"other": GOOD["quick"]}}))
    (sticky / "models.yaml").unlink()
    plant(sticky / "models.yaml", theirs)
    before, kept = snapshot(sticky), theirs.read_bytes()
    with pytest.raises(Invalid) as refused:
        install(sticky / "models.yaml", mine / "new.yaml" if source == "FILE" else None)
    assert f"{sticky / 'models.yaml'}: a link owned by another user, nobody" in \
        str(refused.value) or f"{sticky / 'models.yaml'} is a link owned by another user, " \
        "nobody" in str(refused.value)
    assert snapshot(sticky) == before and theirs.read_bytes() == kept


@needs_root
def test_the_models_files_mode_and_owner_are_kept_over_a_reload(sticky):
    """A reload wrote the models file 0644 (the umask's), however private it was."""
    models = sticky / "models.yaml"
    models.chmod(0o640)
    os.chown(models, 0, NOBODY.pw_gid)  # readable by a group (of the worker's user, say)
    install(models, sticky.parent / "mine" / "new.yaml")
    assert yaml.safe_load(models.read_text())["models"] == NEW
    for path in (models, sticky / "models.yaml.previous"):
        info = path.stat()
        assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == \
            (0o640, 0, NOBODY.pw_gid), path


def test_a_first_install_is_not_left_writable_by_others(tmp_path):
    tmp_path.chmod(0o755)
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump({"models": NEW}))
    new.chmod(0o666)
    target = tmp_path / "models.yaml"
    install(target, new)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert not (tmp_path / "models.yaml.previous").exists()


@pytest.fixture
def operator_files(tmp_path) -> dict[str, Path]:
    tmp_path.chmod(0o755)
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"name": "a", "sha256": "0" * 64}]}))
    settings = tmp_path / "service.yaml"
    settings.write_text(yaml.safe_dump({"api_keys_file": str(keys)}))
    for path in (keys, settings):
        path.chmod(0o644)
    return {"IQ_CONFIG": settings, "IQ_API_KEYS_FILE": keys}


@pytest.mark.parametrize("variable", ["IQ_CONFIG", "IQ_API_KEYS_FILE"])
def test_a_settings_or_keys_file_others_may_write_is_refused_in_one_line(operator_files,
                                                                         variable):
    path = operator_files[variable]
    assert operator_file_problems(str(operator_files["IQ_CONFIG"]),
                                  str(operator_files["IQ_API_KEYS_FILE"])) == []
    path.chmod(0o666)
    (line,) = operator_file_problems(str(operator_files["IQ_CONFIG"]),
                                     str(operator_files["IQ_API_KEYS_FILE"]))
    assert line.startswith(f"{variable} {path}: writable by everyone (mode 0666); ")
    assert "\n" not in line


@needs_root
def test_group_write_and_a_folder_above_name_the_group_and_the_folder(operator_files):
    keys = operator_files["IQ_API_KEYS_FILE"]
    keys.chmod(0o664)
    os.chown(keys, 0, NOBODY.pw_gid)  # nobody's group: other users in it
    (line,) = operator_file_problems("", str(keys))
    assert line.startswith(f"IQ_API_KEYS_FILE {keys}: writable by group 'nogroup', which has "
                           "other users (mode 0664); ")
    keys.chmod(0o644)
    keys.parent.chmod(0o777)
    assert writable_by_others(keys) == f"{keys.parent} is writable by everyone (mode 0777)"


@needs_root
def test_a_keys_file_linked_by_another_user_is_refused(operator_files, tmp_path):
    keys = operator_files["IQ_API_KEYS_FILE"]
    linked = tmp_path / "linked-keys.yaml"
    plant(linked, keys)
    (line,) = operator_file_problems("", str(linked))
    assert line.startswith(f"IQ_API_KEYS_FILE {linked}: a link owned by another user, nobody")


@pytest.mark.parametrize("variable", ["IQ_CONFIG", "IQ_API_KEYS_FILE"])
def test_make_run_stops_on_a_settings_or_keys_file_others_may_write(operator_files, tmp_path,
                                                                    variable):
    operator_files[variable].chmod(0o666)
    env = {k: v for k, v in os.environ.items()
           if k not in ("REDIS_URL", "IQ_MODELS_FILE", "IQ_API_KEYS_FILE", "IQ_CONFIG")}
    env.update({name: str(free_port()) for name in PORTS}, IQ_VAR_DIR=str(tmp_path / "var"),
               IQ_CONFIG=str(operator_files["IQ_CONFIG"]))
    # Its own session and free ports: a make run that is not refused starts a whole stack.
    run = subprocess.Popen([str(ROOT / "scripts" / "run.sh")], cwd=ROOT, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           start_new_session=True)
    try:
        _out, stderr = run.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # not refused: make run stops all it started
        os.killpg(run.pid, signal.SIGTERM)
        run.communicate(timeout=90)
        raise
    assert run.returncode != 0
    (line,) = [line for line in stderr.splitlines() if variable in line]
    assert line.startswith(f"make run: {variable} {operator_files[variable]}: writable by "
                           "everyone (mode 0666); ")
    assert not (tmp_path / "var").exists()


def test_make_reload_refuses_a_keys_file_others_may_write_and_changes_nothing(
        operator_files, tmp_path):
    """A reload restarts the API processes, which read the keys file again (README): it is
    checked as the models file is."""
    target = tmp_path / "models.yaml"
    target.write_text(yaml.safe_dump({"models": GOOD}))
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump({"models": NEW}))
    keys = operator_files["IQ_API_KEYS_FILE"]
    keys.chmod(0o646)
    before, said = target.read_bytes(), []
    result = reload(new, say=said.append, timeout_s=1, settings=Settings(
        models_file=str(target), api_keys_file=str(keys), redis_url="redis://127.0.0.1:1/0"))
    assert result.status == INVALID
    (line,) = said
    assert line.startswith(f"reload refused, nothing changed: IQ_API_KEYS_FILE {keys}: "
                           "writable by everyone (mode 0646); ")
    assert target.read_bytes() == before
    assert not (tmp_path / "models.yaml.previous").exists()
