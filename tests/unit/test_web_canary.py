"""The web server's canary (web/canary.py), run as a models reload's API process runs it: `python
-m web.canary` in a process of its own, in the folder gunicorn's master reads gunicorn.conf.py
and web/ from at a SIGHUP. Here that folder is a copy of them; the rest of the service (config/,
which gunicorn.conf.py imports) is the repository's, on PYTHONPATH, behind the copy."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of what gunicorn's master reads at a SIGHUP."""
    shutil.copytree(ROOT / "web", tmp_path / "web",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "gunicorn.conf.py", tmp_path / "gunicorn.conf.py")
    return tmp_path


def canary(folder: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "web.canary"], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=60)


def refused(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    return lines[0]


def test_the_tree_as_it_is_loads(tree):
    done = canary(tree)
    assert (done.returncode, done.stdout) == (0, ""), (done.stdout, done.stderr)


def test_a_syntax_error_in_a_web_module_names_the_file(tree):
    answer = tree / "web" / "answer.py"
    answer.write_text(answer.read_text() + "\ndef broken(:\n")
    line = refused(canary(tree))
    assert line.startswith("web/answer.py does not load: SyntaxError: "), line
    assert "line " in line, line


def test_an_import_time_error_in_a_web_module_names_the_file(tree):
    answer = tree / "web" / "answer.py"
    answer.write_text(answer.read_text() + "\nraise RuntimeError('half a deploy')\n")
    line = refused(canary(tree))
    assert line == "web/answer.py does not load: RuntimeError: half a deploy", line


def test_a_name_gunicorn_conf_imports_from_web_that_is_gone_is_said(tree):
    worker = tree / "web" / "worker.py"
    worker.write_text(worker.read_text().replace("class Worker(", "class Renamed("))
    line = refused(canary(tree))
    assert line == ("gunicorn.conf.py does not load: ImportError: cannot import name "
                    "'Worker' from 'web.worker'"), line


def test_a_syntax_error_in_gunicorn_conf_names_the_file(tree):
    conf = tree / "gunicorn.conf.py"
    conf.write_text(conf.read_text() + "\ntimeout = = 60\n")
    line = refused(canary(tree))
    assert line.startswith("gunicorn.conf.py does not load: SyntaxError: "), line


def test_gunicorn_conf_is_compiled_not_run_and_nothing_is_patched(tree):
    """Its body makes folders and raises the file limit (the master's to do): a body that
    would fail when run is no fault the canary can see, and it runs none of it. Importing
    web.worker imports gevent but patches nothing."""
    conf = tree / "gunicorn.conf.py"
    conf.write_text(conf.read_text() + "\nopen('ran', 'w').close()\n")
    done = subprocess.run(
        [sys.executable, "-c", "import sys, gevent.monkey, web.canary\n"
         "assert web.canary.check() == ''\n"
         "assert not gevent.monkey.is_anything_patched()\n"
         "assert 'web.worker' in sys.modules\n"],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not (tree / "ran").exists()
