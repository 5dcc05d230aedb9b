"""A pool child that cannot load its models stops its worker (workers/main.py `load_models`),
and the worker then exits with status 1 and the child's reason in one line, so that what
keeps it (make run's keeper, scripts/respawn.py; systemd) sees a failure: it used to exit 0,
as after an operator's stop. The child writes its reason to a file in its worker's own folder
(workers/spawn.py), then sends the main process SIGTERM (its warm shutdown: what it holds goes
back to the queues); the main process reads the reason as it shuts down."""
from __future__ import annotations

import logging
import os

from config.values import shortened
from workers.spawn import own_folder

logger = logging.getLogger(__name__)

_MOST = 400  # characters of the reason kept: one line


def _where() -> str:
    folder = own_folder()
    return str(folder / "reason") if folder else ""


def record(reason: str) -> None:
    """In a child that could not load its models: its reason, one line (the first child's
    is kept)."""
    path, line = _where(), " ".join(reason.split())
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return  # another child's came first
    except OSError as exc:  # its folder gone (a cleaner of /tmp): said, as its worker may not
        logger.error("the reason this child could not load its models was not kept for its "
                     "worker's exit status (%s): %s", exc, line)
        return
    with os.fdopen(fd, "w") as out:
        out.write(shortened(line, _MOST))


def reason() -> str:
    """In the main process: a child's reason ("" when none could not load)."""
    path = _where()
    try:
        with open(path, encoding="utf-8", errors="replace") as found:
            return found.read().strip()
    except OSError:
        return ""
