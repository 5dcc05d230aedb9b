"""`make run` refuses model files other users may write (scripts/preflight.py): a model file
is code the worker runs."""
from __future__ import annotations

import os
import struct
import pwd
import subprocess
from pathlib import Path

import pytest
import yaml

from scripts.preflight import model_file_problems
from scripts.stack import ROOT

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a file away needs root")


@pytest.fixture
def declared(tmp_path) -> tuple[Path, Path, Path]:
    """A models file declaring a TorchScript file and a Hugging Face folder, all private."""
    tmp_path.chmod(0o755)
    weights = tmp_path / "affine.pt"
    weights.write_bytes(b"not loaded here")
    folder = tmp_path / "encoder"
    (folder / "1_Pooling").mkdir(parents=True)
    (folder / "1_Pooling" / "config.json").write_text("{}")
    (folder / "config.json").write_text("{}")
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": {
        "affine": {"kind": "torchscript", "path": "affine.pt", "input_shape": [4]},
        "encoder": {"kind": "sequence-classification", "path": "encoder"}}}))
    for path in (weights, models, folder / "config.json", folder / "1_Pooling" / "config.json"):
        path.chmod(0o644)
    for path in (folder, folder / "1_Pooling"):
        path.chmod(0o755)
    return models, weights, folder


def test_private_model_files_pass(declared):
    models, _weights, _folder = declared
    assert model_file_problems(str(models)) == []


@pytest.mark.parametrize("target, mode, why", [
    ("models", 0o666, "writable by everyone (mode 0666)"),
    ("weights", 0o646, "writable by everyone (mode 0646)"),
    ("inner", 0o666, "writable by everyone (mode 0666)"),
    ("folder", 0o777, "writable by everyone (mode 0777)"),
    ("parent", 0o777, "writable by everyone (mode 0777)"),
])
def test_a_model_file_others_may_write_is_refused_by_name(declared, target, mode, why):
    models, weights, folder = declared
    path = {"models": models, "weights": weights, "inner": folder / "1_Pooling" / "config.json",
            "folder": folder, "parent": models.parent}[target]
    path.chmod(mode)
    problems = model_file_problems(str(models))
    assert problems == [f"make run: {path} is {why}. A model file is code the worker runs, so "
                        f"only you (or root) may write it: chmod go-w '{path}' (or chown it "
                        f"to yourself)."]


def test_a_sticky_folder_such_as_tmp_is_no_problem(declared):
    models, _weights, _folder = declared
    models.parent.chmod(0o1777)
    assert model_file_problems(str(models)) == []


@needs_root
def test_group_write_counts_only_when_the_group_has_other_users(declared):
    models, weights, _folder = declared
    weights.chmod(0o664)
    os.chown(weights, 0, 0)  # root's own group: no other user in it
    assert model_file_problems(str(models)) == []
    os.chown(weights, 0, pwd.getpwnam("nobody").pw_gid)  # nobody's group: others in it
    (problem,) = model_file_problems(str(models))
    assert f"{weights} is writable by group 'nogroup', which has other users (mode 0664)" \
        in problem


@needs_root
def test_a_file_owned_by_another_user_is_refused(declared):
    models, weights, _folder = declared
    os.chown(weights, 4321, 4321)
    (problem,) = model_file_problems(str(models))
    assert f"{weights} is owned by another user, uid 4321" in problem


def test_make_run_stops_before_starting_anything(declared, tmp_path):
    models, weights, _folder = declared
    weights.chmod(0o666)
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "IQ_MODELS_FILE")}
    done = subprocess.run([str(ROOT / "scripts" / "run.sh")], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=dict(env, IQ_MODELS_FILE=str(models),
                                                          IQ_VAR_DIR=str(tmp_path / "var")))
    assert done.returncode != 0
    assert f"make run: {weights} is writable by everyone (mode 0666)" in done.stderr
    assert not (tmp_path / "var").exists()


# What decides a model file is more than the file and its folder (the attack on issue 26, F6):
# each case below let another user change what the worker loads, and passed before.

def test_a_folder_above_the_parent_others_may_write_is_refused(declared):
    models, _weights, _folder = declared
    above = models.parent / "srv"
    team = above / "team"
    team.mkdir(parents=True)
    for name in ("models.yaml", "affine.pt", "encoder"):
        (models.parent / name).rename(team / name)
    above.chmod(0o777)  # anyone may rename team/ and put their own in its place
    problems = model_file_problems(str(team / "models.yaml"))
    assert any(p.startswith(f"make run: {above} is writable by everyone") for p in problems)


def test_a_models_file_that_links_to_a_file_others_may_write_is_refused(declared, tmp_path):
    models, _weights, _folder = declared
    target = tmp_path / "elsewhere" / "models.yaml"
    target.parent.mkdir(mode=0o755)
    models.rename(target)
    target.chmod(0o666)
    models.symlink_to(target)
    problems = model_file_problems(str(models))
    assert any(p.startswith(f"make run: {target} is writable by everyone") for p in problems)


def test_a_model_link_kept_in_a_folder_others_may_write_is_refused(declared, tmp_path):
    models, weights, _folder = declared
    links = tmp_path / "links"
    links.mkdir()
    links.chmod(0o777)  # anyone may swap the link
    (links / "affine.pt").symlink_to(weights)
    text = models.read_text().replace("path: affine.pt", f"path: {links / 'affine.pt'}")
    models.write_text(text)
    problems = model_file_problems(str(models))
    assert [p for p in problems if p.startswith(f"make run: {links} is writable by everyone")]


def test_a_link_inside_a_model_folder_is_followed(declared, tmp_path):
    models, _weights, folder = declared
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"weights")
    outside.chmod(0o666)
    (folder / "model.safetensors").symlink_to(outside)
    problems = model_file_problems(str(models))
    assert any(p.startswith(f"make run: {outside} is writable by everyone") for p in problems)


# The re-attack on issue 26 (F6): two more layouts that let another user change what is loaded.

def test_each_link_of_a_chain_is_followed_with_its_folder(declared, tmp_path):
    """affine.pt -> pub/mid.pt -> the weights: whoever may write pub/ may point the middle
    link at a file of theirs, though the first link's folder and the final file are private."""
    models, weights, _folder = declared
    links, pub = tmp_path / "links", tmp_path / "pub"
    links.mkdir(mode=0o755)
    pub.mkdir()
    pub.chmod(0o777)
    (pub / "mid.pt").symlink_to(weights)
    (links / "affine.pt").symlink_to("../pub/mid.pt")
    models.write_text(models.read_text().replace("path: affine.pt",
                                                 f"path: {links / 'affine.pt'}"))
    problems = model_file_problems(str(models))
    assert [p for p in problems if p.startswith(f"make run: {pub} is writable by everyone")]


def test_a_linked_folder_inside_a_model_folder_is_walked(declared, tmp_path):
    models, _weights, folder = declared
    shared = tmp_path / "shared" / "pool"
    shared.mkdir(parents=True, mode=0o755)
    (shared / "config.json").write_text("{}")
    (shared / "config.json").chmod(0o666)
    (folder / "2_Dense").symlink_to(shared, target_is_directory=True)
    problems = model_file_problems(str(models))
    inner = folder / "2_Dense" / "config.json"
    assert [p for p in problems if p.startswith(f"make run: {inner} is writable by everyone")]


def test_links_that_loop_end_the_walk(declared):
    models, _weights, folder = declared
    (folder / "1_Pooling" / "again").symlink_to(folder, target_is_directory=True)
    (folder / "a").symlink_to(folder / "b")
    (folder / "b").symlink_to(folder / "a")
    assert model_file_problems(str(models)) == []


def _acl(*entries: tuple[int, int, int]) -> bytes:
    """A system.posix_acl_access value: version 2, then (tag, permissions, id) entries."""
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *entry) for entry in entries)


ANYONE = 0xFFFFFFFF  # the id field of entries that name no one


@pytest.mark.parametrize("mask, refused", [(0o6, True), (0o4, False)])
def test_an_acl_that_lets_another_user_write_is_refused(declared, mask, refused):
    models, weights, _folder = declared
    nobody = pwd.getpwnam("nobody").pw_uid
    os.setxattr(weights, "system.posix_acl_access", _acl(
        (0x01, 0o6, ANYONE), (0x02, 0o6, nobody), (0x04, 0o4, ANYONE),
        (0x10, mask, ANYONE), (0x20, 0o4, ANYONE)))
    problems = model_file_problems(str(models))
    expected = [f"make run: {weights} lets nobody (uid {nobody}) write it through its ACL "
                f"(getfacl '{weights}'). A model file is code the worker runs, so only you (or "
                f"root) may write it: chmod go-w '{weights}' (or chown it to yourself)."]
    assert problems == (expected if refused else [])


def test_a_packaged_models_folder_is_found_without_running_its_packages_code(tmp_path,
                                                                               monkeypatch):
    """These checks run as root under IQ_RUN_USERS=separate: finding `package: outer.inner`
    must not import `outer` (its __init__ is its author's code)."""
    ran = tmp_path / "ran"
    inner = tmp_path / "site" / "outer" / "inner"
    inner.mkdir(parents=True)
    for package in (inner.parent, inner):
        (package / "__init__.py").write_text(
            f"open({str(ran)!r}, 'a').write({package.name!r} + '\\n')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": {"alpha": {
        "kind": "embedding", "package": "outer.inner"}}}))
    from scripts.preflight import model_roots, package_folder

    assert package_folder("outer.inner") == inner
    assert package_folder("outer.missing") is None
    assert list(model_roots(models)) == [inner]
    assert not ran.exists(), ran.read_text()
