"""Each long-lived process freezes its start-up objects out of the garbage collector's full
collections (tasks/heap.py) once it is ready to serve: an API process once its app is loaded
(gunicorn's `post_worker_init`), a worker's main process once its consumer is ready (Celery's
`worker_ready`), a pool child once its models are loaded (`worker_process_init`). Each runs in
a fresh interpreter: the garbage collector's state is the process's."""
from __future__ import annotations

import os
import subprocess
import sys

from scripts.stack import ROOT
from tasks.heap import YOUNG


def _frozen(code: str, **env: str) -> list[int]:
    """What `code` prints: the freeze count after each step, one per line."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return [int(line) for line in out.stdout.split()]


def test_start_up_objects_are_frozen_once_and_later_ones_stay_collectable():
    before, first, again, kept, young = _frozen(
        "import gc; from tasks.heap import freeze_start_up; print(gc.get_freeze_count());"
        "print(freeze_start_up()); jobs = [{'job': i} for i in range(5000)];"
        "print(freeze_start_up()); print(gc.get_freeze_count()); print(gc.get_threshold()[0])")
    assert before == 0
    assert first > 1000  # the interpreter's and the imports' objects
    assert again == kept == first  # the jobs' objects, made after, are not frozen
    assert young == YOUNG > 700  # CPython's default


def test_an_api_process_freezes_once_its_app_is_loaded(tmp_path):
    loaded, initialised = _frozen(
        "import gc, os, runpy, types; conf = runpy.run_path('gunicorn.conf.py');"
        "print(gc.get_freeze_count());"
        "conf['post_worker_init'](types.SimpleNamespace(age=1, pid=os.getpid()));"
        "print(gc.get_freeze_count())", TMPDIR=str(tmp_path))
    assert loaded == 0 and initialised > 1000


def test_a_workers_main_process_freezes_once_its_consumer_is_ready():
    imported, ready = _frozen(
        "import gc; import workers.main; from celery import signals;"
        "print(gc.get_freeze_count()); signals.worker_ready.send(sender=None);"
        "print(gc.get_freeze_count())")
    assert imported == 0 and ready > 1000


def test_a_pool_child_freezes_once_its_models_are_loaded():
    imported, loaded = _frozen(
        "import gc; import workers.main as m;"
        "m.start_runtime = lambda *a: None; m.hold_stops_for_the_main_process = lambda: None;"
        "print(gc.get_freeze_count()); m.load_models('worker');"
        "print(gc.get_freeze_count())")
    assert imported == 0 and loaded > 1000
