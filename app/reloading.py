"""An API process's side of a models-file reload (scripts/reload.py announces one in Redis).

Under gunicorn, each API process looks at the announced revision every heartbeat. When it
differs from the revision of the file the process serves, and the file on disk now has the
announced revision, it first runs a canary of it (app/canary.py: the app built from the new
file with this process's environment, its Redis reached, in a process of its own); only once
the canary started, and the workers serve the file (every live worker on REDIS_URL's Redis
and on the Redis of each group the file's models are on, and at least one on each Redis a
model is on: `workers_on`), does it ask its gunicorn master for a graceful reload (SIGHUP,
once per master and announcement): the master starts new processes, which read the new file
(the app is not preloaded), and the old ones finish the requests they hold before they exit,
so no request is dropped. A canary that fails leaves the master alone (its new processes could not have booted,
and a master whose processes cannot boot exits): the process keeps serving the old file and
refuses the revision, saying why, until it is announced again; it records the failure as a
pool child's failed load is recorded (tasks/reload_failures.py), so that the roll halts and
the workers that began it roll back. A process whose file is not the
announced one (another host's, not yet updated) keeps serving and says so. Each process
reports the revision it serves and what it can serve (tasks/keys.py RELOAD_STATUS_KEY,
tasks/serves.py), for the reload command to check a file against and wait on; once it has
handed over, "handing over" (it may still answer requests with the old file until its master
stops it), until it exits, when it removes its report. Each also keeps its gunicorn's address
and process count in RELOAD_API_KEY, which outlives its processes, so that a reload is done
only once as many processes as before serve the new revision there."""
from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

import orjson
import redis

from app import canary
from config import ConfigError, Settings
from config.models import parse_models, revision_of
from tasks.keys import (MODELS_ANNOUNCEMENTS_KEY, MODELS_REVISION_KEY, PREFIX, RELOAD_API_KEY,
                        RELOAD_STATUS_KEY)
from tasks.lua import script
from tasks.reload_failures import failure_of, record_refusal
from tasks.serves import capabilities

logger = logging.getLogger(__name__)
# Set in each API process by gunicorn.conf.py's post_fork: its gunicorn's address and process
# count (not IQ_ variables: they are no settings).
SERVICE_VARIABLE, PROCESSES_VARIABLE = "_IQ_API_BIND", "_IQ_API_PROCESSES"

# A master's claim of the SIGHUP of an announcement (tasks/lua/reload_hup_claim.lua): 1 unless
# the master was sent one for it after the asking process read its file.
_CLAIM = script("reload_hup_claim")


class ModelsWatch:
    """One per API process under gunicorn; `master`: the gunicorn master's pid."""

    def __init__(self, client: redis.Redis, settings: Settings, revision: str,
                 master: int, canary: Callable[[str], str] = canary.run,
                 started: float | None = None,
                 groups: Mapping[str, redis.Redis] | None = None) -> None:
        self.client, self.settings, self.revision, self.master = (client, settings, revision,
                                                                  master)
        # Each Redis group's client (app/groups.py): a model on a group is served by the
        # workers that report there.
        self.groups = dict(groups or {})
        self.canary = canary
        # When the process read the models file it serves (before the app was built): a
        # SIGHUP its master was sent before then did not replace it.
        self.started = time.time() if started is None else started
        self.field = f"api:{socket.gethostname()}/{os.getpid()}"
        # The gunicorn it belongs to: its address, and how many processes it runs (set by
        # gunicorn.conf.py's post_fork; absent outside gunicorn).
        bind = os.environ.get(SERVICE_VARIABLE) or f"master {master}"
        self.service = f"{socket.gethostname()} {bind}"
        self.processes = int(os.environ.get(PROCESSES_VARIABLE) or 1)
        self.error = ""
        self.refused: tuple[str, str | None] | None = None  # (revision, its announcement)
        self.handed_over = False
        self.exiting = False
        # The announcement whose canary started: the process then waits (a check each
        # heartbeat) until the workers serve it (`_workers`) before it hands over.
        self.canaried: tuple[str, str | None] | None = None
        self.waiting = ""  # which workers it waits for, said in its report

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
            announced, number = self.client.mget(MODELS_REVISION_KEY, MODELS_ANNOUNCEMENTS_KEY)
            if announced and announced != self.revision and \
                    self.refused != (announced, number):
                self._reload_to(announced, number)
            elif announced == self.revision:
                # a failed reload undone
                self.error, self.refused, self.waiting, self.canaried = "", None, "", None
        # Handed over, it is pending still: its master stops it only after the processes
        # that replace it started, and it answers requests with the old file until then.
        state = "handing over" if self.handed_over else "refused" if self.error else \
            "waiting for the workers" if self.waiting else "serving"
        status = {"revision": self.revision, "state": state, "at": time.time(),
                  "error": self.error, "workers_pending": self.waiting,
                  "service": self.service, **capabilities(self.settings)}
        if self.refused:  # its canary failed: refused until announced again
            status.update(refused=self.refused[0], announcement=self.refused[1])
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hset(RELOAD_STATUS_KEY, self.field, orjson.dumps(status))
            pipe.hset(RELOAD_API_KEY, self.service, orjson.dumps(
                {"processes": self.processes, "at": status["at"]}))
            pipe.execute()

    def gone(self) -> None:
        """At the process's exit: its report goes (else it lapses after a few heartbeats),
        and the watch writes none again."""
        self.exiting = True
        try:
            self.client.hdel(RELOAD_STATUS_KEY, self.field)
        except redis.RedisError as exc:
            logger.debug("models watch: report not removed: %s", exc)

    def _reload_to(self, announced: str, number: str | None = None) -> None:
        path, content = Path(self.settings.models_file), b""
        try:
            content = path.read_bytes()
            found = revision_of(content)
        except OSError as exc:
            found = f"unreadable ({exc})"
        if found != announced:
            error = f"{path} has revision {found}, not the announced {announced}"
            if error != self.error:
                logger.error("models reload refused, still serving revision %s: %s",
                             self.revision, error)
            self.error = error
            return
        try:
            why = self.canary(announced) if self.canaried != (announced, number) else ""
        except redis.RedisError as exc:  # its own Redis away: not the file's fault
            logger.warning("models reload: %s; tried again at the next heartbeat", exc)
            raise
        if why:
            # Tried again only when announced again (an operator fixed what failed). Recorded
            # as a failed load is: the roll halts, the workers that began it roll back.
            self.refused = (announced, number)
            self.error = f"the API could not start on models file revision {announced} " \
                         f"(its canary: {why}); still serving revision {self.revision}"
            logger.error("models reload refused: %s", self.error)
            record_refusal(self.client, announced, self.field, f"its canary: {why}")
            return
        self.canaried = (announced, number)
        refused, waiting = self._workers(path, content, announced, number)
        if refused:
            # A worker refused or failed to load it: the old file stays served (the reload
            # is undone, or announced again once its host is fixed).
            self.refused, self.waiting = (announced, number), ""
            self.error = f"worker(s) did not take models file revision {announced} " \
                         f"({refused}); still serving revision {self.revision}"
            logger.error("models reload refused: %s", self.error)
            return
        if waiting:  # looked at again next heartbeat: the API never runs ahead of them
            if waiting != self.waiting:
                logger.info("models file revision %s: its canary started; waiting for %s "
                            "to serve it", announced, waiting)
            self.waiting = waiting
            return
        self.waiting = ""
        # One SIGHUP per master and announcement, whichever of its processes sees it first:
        # the master's claim holds the announcement (its number and revision) it was last sent
        # a SIGHUP for, and when. Per announcement, not per revision: a process started by a
        # SIGHUP for revision A that read the file after A's rollback must get its own when A
        # is announced again. The process hands over only once a SIGHUP for this announcement
        # was sent after it read its file: only such a SIGHUP replaces it.
        claim = f"{PREFIX}reload:hup:{socket.gethostname()}:{self.master}"
        if self.client.eval(_CLAIM, 1, claim, number or "", announced, repr(self.started),
                            repr(time.time())):
            logger.info("models file revision %s announced (%s): reloading gunicorn (pid %d) "
                        "gracefully", announced, number, self.master)
            os.kill(self.master, signal.SIGHUP)
        self.handed_over, self.error = True, ""

    def _workers(self, path: Path, content: bytes, announced: str,
                 number: str | None) -> tuple[str, str]:
        """`workers_on` REDIS_URL's Redis (its workers take every announcement) and on the
        Redis of each group the file's models are on, joined: a model is taken only once the
        workers that would run its jobs serve the file, and, on each Redis a model of it is
        on, once a worker there reports at all."""
        try:
            named = {spec.redis for spec in parse_models(path, content).values()}
        except ConfigError:  # its canary started: not met, but then every group counts
            named = {""} | set(self.groups)
        refused, waiting = [], []
        for group in sorted(named | {""}):
            client = self.groups.get(group) if group else self.client
            if client is None:
                continue  # a group this process lacks: its canary refused the file
            try:
                one = workers_on(client, announced, None if group else number,
                                 self.settings.heartbeat_interval_s, needed=group in named,
                                 group=group)
            except redis.RedisError as exc:
                one = "", f"the workers of group {group} (its Redis: {exc})"
            refused.append(one[0])
            waiting.append(one[1])
        return "; ".join(filter(None, refused)), ", ".join(filter(None, waiting))


# A worker's report older than this many heartbeats is of a worker that is gone (as
# scripts/reload_wait.py STALE_BEATS).
_STALE_BEATS = 5


def workers_on(client: redis.Redis, revision: str, number: str | None,
               beat_s: float, needed: bool = False, group: str = "") -> tuple[str, str]:
    """Where the live workers on `client`'s Redis (group `group`'s, "" REDIS_URL's) stand
    with `revision` (announcement `number`; None: the one announced there): (the ones that
    refused it or could not load it, the ones not serving it yet), each "" or their names.
    An API process takes a new file only once both are "", so that it never accepts a job
    for a model no worker serves yet, nor stops taking one for a model the workers still
    serve. `needed`: a model of the file is on this Redis, so a worker must report there
    (none does while none runs or consumes yet: the file is not taken for want of one)."""
    failure = failure_of(client, revision)
    if failure:
        return f"{failure.get('worker', 'a worker')}: {failure.get('error')}", ""
    where = f" (group {group})" if group else ""
    if number is None:
        announced, number = client.mget(MODELS_REVISION_KEY, MODELS_ANNOUNCEMENTS_KEY)
        if announced != revision:  # make reload announces on each group before REDIS_URL's
            return "", f"the workers{where}: not announced there yet"
    now, refused, waiting, live = time.time(), [], [], 0
    for name, raw in client.hgetall(RELOAD_STATUS_KEY).items():
        if not name.startswith("worker:"):
            continue
        status = orjson.loads(raw)
        if now - float(status.get("at", 0)) > _STALE_BEATS * beat_s:
            continue
        live += 1
        if status.get("refused") == revision and \
                status.get("announcement", number) == number:
            refused.append(f"{name}{where}: {status.get('error')}")
        elif status.get("revision") != revision or status.get("state") != "serving":
            waiting.append(f"{name}{where}")
    if needed and not live:
        waiting.append(f"a worker on {'group ' + group if group else 'REDIS_URL'}'s Redis "
                       "(none reports: none runs, or none consumes yet)")
    return "; ".join(refused), ", ".join(sorted(waiting))
