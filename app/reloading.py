"""An API process's side of a models-file reload (scripts/reload.py announces one in Redis).

Under gunicorn, each API process looks at the announced revision every heartbeat. When it
differs from the revision of the file the process serves, and the file on disk now has the
announced revision, it asks its gunicorn master for a graceful reload (SIGHUP, once per master
and revision): the master starts new processes, which read the new file (the app is not
preloaded), and the old ones finish the requests they hold before they exit, so no request is
dropped. A process whose file is not the announced one (another host's, not yet updated)
keeps serving and says so. Each process reports the revision it serves (tasks/keys.py
RELOAD_STATUS_KEY), for the reload command to wait on; once it has handed over, "handing
over" (it may still answer requests with the old file until its master stops it), until it
exits, when it removes its report."""
from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

import orjson
import redis

from config import Settings
from config.models import revision_of
from tasks.keys import MODELS_REVISION_KEY, PREFIX, RELOAD_STATUS_KEY
from tasks.lua import script

logger = logging.getLogger(__name__)

# A master's claim of the SIGHUP of a revision (tasks/lua/reload_hup_claim.lua): 1 unless the
# master was sent one for it already.
_CLAIM = script("reload_hup_claim")


class ModelsWatch:
    """One per API process under gunicorn; `master`: the gunicorn master's pid."""

    def __init__(self, client: redis.Redis, settings: Settings, revision: str,
                 master: int) -> None:
        self.client, self.settings, self.revision, self.master = (client, settings, revision,
                                                                  master)
        self.field = f"api:{socket.gethostname()}/{os.getpid()}"
        self.error = ""
        self.handed_over = False
        self.exiting = False

    def start(self) -> None:
        atexit.register(self.gone)
        threading.Thread(target=self._run, name="iq-models-watch", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                self.check()
            except redis.RedisError as exc:
                logger.debug("models watch: %s", exc)
            time.sleep(self.settings.heartbeat_interval_s)

    def check(self) -> None:
        if self.exiting:
            return
        if not self.handed_over:
            announced = self.client.get(MODELS_REVISION_KEY)
            if announced and announced != self.revision:
                self._reload_to(announced)
        # Handed over, it is pending still: its master stops it only after the processes
        # that replace it started, and it answers requests with the old file until then.
        state = "handing over" if self.handed_over else "refused" if self.error else "serving"
        status = {"revision": self.revision, "state": state, "at": time.time(),
                  "error": self.error}
        self.client.hset(RELOAD_STATUS_KEY, self.field, orjson.dumps(status))

    def gone(self) -> None:
        """At the process's exit: its report goes (else it lapses after a few heartbeats),
        and the watch writes none again."""
        self.exiting = True
        try:
            self.client.hdel(RELOAD_STATUS_KEY, self.field)
        except redis.RedisError as exc:
            logger.debug("models watch: report not removed: %s", exc)

    def _reload_to(self, announced: str) -> None:
        path = Path(self.settings.models_file)
        try:
            found = revision_of(path.read_bytes())
        except OSError as exc:
            found = f"unreadable ({exc})"
        if found != announced:
            error = f"{path} has revision {found}, not the announced {announced}"
            if error != self.error:
                logger.error("models reload refused, still serving revision %s: %s",
                             self.revision, error)
            self.error = error
            return
        # One SIGHUP per master and reload, whichever of its processes sees it first: the
        # master's claim holds the revision it was last sent a SIGHUP for, so that a reload
        # back to a revision it served before (A, B, then A or B again) is one too.
        claim = f"{PREFIX}reload:hup:{socket.gethostname()}:{self.master}"
        if self.client.eval(_CLAIM, 1, claim, announced):
            logger.info("models file revision %s announced: reloading gunicorn (pid %d) "
                        "gracefully", announced, self.master)
            os.kill(self.master, signal.SIGHUP)
        self.handed_over, self.error = True, ""
