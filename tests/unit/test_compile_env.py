"""scripts/compile_env.py: the environment's bytecode, compiled on every core after pip's
--no-compile install, whatever PYTHONDONTWRITEBYTECODE says."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig

from scripts import compile_env


def test_each_share_is_compiled_beside_its_files_and_a_file_that_does_not_compile_is_left(
        tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # as PYTHONDONTWRITEBYTECODE sets
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text("VALUE = 1\n")
    bad.write_text("def broken(:\n")  # as some packages ship files for other Pythons
    compile_env._compile([str(bad), str(good)])
    assert (tmp_path / importlib.util.cache_from_source(str(good))).exists()
    assert not (tmp_path / importlib.util.cache_from_source(str(bad))).exists()


def test_the_files_are_this_environments_packages():
    files = compile_env.package_files()
    site = sysconfig.get_paths()["purelib"]
    assert files and all(path.endswith(".py") for path in files)
    assert any(path.startswith(site) and "/celery/" in path for path in files)
    # A package's test suite is left out; a module of that name is not.
    assert not any("/numpy/_core/tests/" in path for path in files)
    assert any(path.endswith("/jinja2/tests.py") for path in files)


def test_the_projects_files_are_those_git_tracks_in_the_checkout(tmp_path):
    """`--project` (make test, before the tests): the checkout's own modules, not an untracked
    file beside them nor the environment's packages."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "pkg").mkdir()
    for name in ("pkg/mod.py", "pkg/scratch.py", "README.md"):
        (tmp_path / name).write_text("VALUE = 1\n")
    subprocess.run(["git", "add", "pkg/mod.py", "README.md"], cwd=tmp_path, check=True)
    assert compile_env.project_files(tmp_path) == [str(tmp_path / "pkg/mod.py")]
    ours = compile_env.project_files()
    assert str(compile_env.ROOT / "workers/main.py") in ours
    assert not any("/.venv/" in path or "/site-packages/" in path for path in ours)


def test_a_copy_git_cannot_read_is_compiled_whole_and_said_so(tmp_path, capsys):
    """An export (`git archive`) or a checkout another user owns: `make test` goes on."""
    for name in ("pkg/mod.py", "pkg/sub/deep.py", ".venv/lib/site.py", "var/x/old.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("VALUE = 1\n")
    whole = [str(tmp_path / "pkg/mod.py"), str(tmp_path / "pkg/sub/deep.py")]
    assert compile_env.project_files(tmp_path) == whole
    assert "compile_env: git lists no files here (fatal: " in capsys.readouterr().err
    # An export unpacked inside another checkout: git answers, listing nothing of it.
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert compile_env.project_files(tmp_path) == whole
    assert "none of its files is tracked" in capsys.readouterr().err
