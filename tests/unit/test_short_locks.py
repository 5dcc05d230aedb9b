"""Under gevent's monkey-patching (the API's gunicorn worker), the locks of the API's short
sections taken on every request are the interpreter's (tasks/locks.py), not gevent's, which
cost a call in Python each; the waiter's lock around starting its listener stays gevent's,
since starting a thread waits."""
from __future__ import annotations

import subprocess
import sys

PROBE = """
from gevent import monkey
monkey.patch_all()
import _thread, threading
from app.waiter import ResultWaiter
from tasks.group_commit import GroupCommit
from tasks.locks import short_lock
from tasks.redis_deadline import Deadline

real = type(monkey.get_original("_thread", "allocate_lock")())
waiter = ResultWaiter(client=type("C", (), {"get_encoder": lambda self: type(
    "E", (), {"decode_responses": False})()})(), max_waits=1, max_per_key=1)
print(type(short_lock()) is real, type(short_lock()) is real, type(Deadline(1)._lock) is real,
      type(waiter.slots._lock) is real, type(waiter._lock) is real,
      type(GroupCommit(lambda items: items)._lock) is real,
      type(waiter._starting) is type(threading.Lock()) and type(waiter._starting) is not real)
"""


def test_the_per_request_locks_are_the_interpreters_under_gevent():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True"] * 7, out
