"""app/hangup.py's watch finds its request in one look-up (issue 40: it is armed at every wait)."""
from __future__ import annotations

import sys
import threading

from flask import Flask

from app import hangup


def test_the_watch_looks_its_request_up_once():
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith(("werkzeug/local.py",
                                                                   "flask/ctx.py")):
            calls.append(frame.f_code.co_name)

    wake = threading.Event()
    with Flask(__name__).test_request_context("/v1/jobs/x"):
        sys.setprofile(profile)
        try:
            watched = hangup.watch(wake)  # no gunicorn socket: nothing to watch
        finally:
            sys.setprofile(None)
    watched.stop()
    assert calls == ["_get_current_object"]
    assert not watched.gone.is_set() and not wake.is_set()


def test_outside_a_request_nothing_is_watched():
    watched = hangup.watch(threading.Event())
    watched.stop()
    assert not watched.gone.is_set()
