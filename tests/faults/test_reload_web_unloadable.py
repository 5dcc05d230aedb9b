"""A models reload while the web server's code on disk does not load (a half-finished deploy
of web/), on the default settings, under load: gunicorn's master reads gunicorn.conf.py and
imports web/ anew at the SIGHUP, and one that cannot exits, its processes orphaned, the API
down. The API
process's canary (app/canary.py, web/canary.py) checks what the master would read first: `make
reload` exits 2 with the one line naming the file, the previous models file back, the master
alive and serving the old revision throughout, every accepted job run once.

The API runs from a folder of its own holding a copy of gunicorn.conf.py and web/ (the rest of
the service on PYTHONPATH behind it), so that the test breaks the copy, not the repository."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import requests

from config.models import revision_of
from scripts.processes import ROOT, VENV_BIN, Service, free_port
from scripts.stack import launch, wait_until
from tasks.keys import RELOAD_API_KEY
from tests.faults.test_reload_unloadable import check_every_job, instances
from tests.faults.test_reload_unservable import api_processes, reload, served_revision
from tests.support.load import Load

pytestmark = pytest.mark.slow


def start_api_in(folder, env: dict[str, str], logdir) -> Service:
    """`gunicorn app.wsgi:app` as scripts/web.sh runs it, in `folder`."""
    port = free_port()
    log = logdir / "web-copy.log"
    proc = subprocess.Popen([str(VENV_BIN / "gunicorn"), "--bind", f"127.0.0.1:{port}",
                             "app.wsgi:app"], cwd=folder, env=env, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    svc = Service("web-copy", proc, log, {"port": port, "url": f"http://127.0.0.1:{port}"})
    svc.wait_ready(lambda: requests.get(f"{svc.extra['url']}/healthz", timeout=2).ok, 120,
                   "the API in its own folder")
    return svc


def test_a_reload_while_web_does_not_load_is_refused_and_the_api_stays_up(tmp_path):
    quick = {"kind": "synthetic", "base_ms": 20, "per_item_ms": 0, "max_batch_size": 4,
             "runs_log": str(tmp_path / "runs.log")}
    stack = launch(tmp_path, {"quick": quick}, {"w": None}, defaults=True)
    served = tmp_path / "served"
    shutil.copytree(ROOT / "web", served / "web", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "gunicorn.conf.py", served / "gunicorn.conf.py")
    models_file = tmp_path / "models.yaml"
    old_bytes = models_file.read_bytes()
    old = revision_of(old_bytes)
    load = None
    try:
        # launch's own API gone, its gunicorn forgotten (a reload waits for as many processes
        # as a gunicorn ran: app/reloading.py): the one in its own folder replaces it.
        stack.web.stop()
        stack.redis.delete(RELOAD_API_KEY)
        stack.web = start_api_in(served, {**stack.env, "PYTHONPATH": str(ROOT)}, tmp_path)
        stack.api = stack.web.extra["url"]
        wait_until(lambda: len(api_processes(stack)) == 1, 60, "the API process's report")
        before = set(api_processes(stack))
        load = Load(stack.api, "quick", "load", clients=2, pause_s=0.2).start()
        wait_until(lambda: len(load.accepted) > 10, 60, "the load to run")
        answer = served / "web" / "answer.py"
        answer.write_text(answer.read_text() + "\ndef half_deployed(:\n")

        done = reload(stack, {"quick": {**quick, "version": "2"}})
        assert done.returncode == 2, done.stdout + done.stderr
        assert "not undone everywhere" not in done.stdout, done.stdout
        assert "its canary: the web server's code on disk: web/answer.py does not load: " \
               "SyntaxError: " in done.stdout, done.stdout
        # The master never read the broken code: alive, the same process serving the old file.
        assert stack.web.proc.poll() is None, stack.web.tail()
        assert "Failed to read config file" not in stack.web.tail()
        assert set(api_processes(stack)) == before
        assert served_revision(stack) == old
        assert models_file.read_bytes() == old_bytes
        wait_until(lambda: instances(stack) == 1, 60, "the worker's child live")
        load.stop()
        check_every_job(stack, load)  # every accepted job succeeded, each ran once
    finally:
        if load is not None:
            load.stop()
        stack.stop()
