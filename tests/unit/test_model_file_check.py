"""`make run` refuses model files other users may write (scripts/preflight.py): a model file
is code the worker runs."""
from __future__ import annotations

import os
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
    assert f"{weights} is writable by its group, which has other users (mode 0664)" in problem


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
