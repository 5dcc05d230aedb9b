"""A pool child that cannot load its models stops its worker (workers/main.py `load_models`),
and the worker then exits with status 1 and the child's reason in one line, so that what
keeps it (make run's keeper, scripts/respawn.py; systemd) sees a failure: it used to exit 0,
as after an operator's stop. The child writes its reason to a file its main process named
in the environment (spawned children inherit it), in a folder of the main process's own
(mkdtemp: 0700), then sends the main process SIGTERM (its warm shutdown: what it holds goes
back to the queues); the main process reads the reason as it shuts down."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Where the reason goes (not an IQ_ setting: the main process sets it for its children).
VARIABLE = "_IQ_LOAD_FAILURE_FILE"
_MOST = 400  # characters of the reason kept: one line


def arm() -> None:
    """In the main process, before its children start: a place for their reason."""
    folder = tempfile.mkdtemp(prefix="iq-worker-")
    os.environ[VARIABLE] = os.path.join(folder, "reason")
    atexit.register(shutil.rmtree, folder, True)


def record(reason: str) -> None:
    """In a child that could not load its models: its reason, one line (the first child's
    is kept)."""
    path = os.environ.get(VARIABLE)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return  # another child's came first
    with os.fdopen(fd, "w") as out:
        out.write(" ".join(reason.split())[:_MOST])


def reason() -> str:
    """In the main process: a child's reason ("" when none could not load)."""
    path = os.environ.get(VARIABLE)
    try:
        with open(path or "", encoding="utf-8", errors="replace") as found:
            return found.read().strip()
    except OSError:
        return ""
