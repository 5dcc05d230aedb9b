"""Where the processes stand with an announced models file, for `make reload`
(scripts/reload.py) to wait on: each process's report (workers/reload.py, app/reloading.py),
the consuming workers, a failed load a worker's new pool child recorded
(tasks/reload_failures.py), and whether anything moved on since the last look."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import orjson
import redis

from config import Settings
from scripts.reload_moved import move_queued_jobs
from scripts.reload_removed import fail_removed_jobs
from tasks.keys import CONSUMING_KEY, RELOAD_STATUS_KEY
from tasks.reload_failures import failure_of

DONE, REFUSED, TIMED_OUT = 0, 2, 3
# A process's report older than this many heartbeats is a process that is gone.
STALE_BEATS = 5


@dataclass
class Result:
    status: int  # DONE, INVALID (scripts/reload.py), REFUSED or TIMED_OUT
    revision: str = ""
    lines: list[str] = field(default_factory=list)
    failed_load: bool = False  # a worker's new pool child could not load it


def _statuses(client: redis.Redis, beat_s: float) -> dict[str, dict]:
    """The live processes' reports, by field (`worker:<node>`, `api:<host>/<pid>`); reports
    of processes long gone are removed."""
    now, live = time.time(), {}
    for name, raw in client.hgetall(RELOAD_STATUS_KEY).items():
        status = orjson.loads(raw)
        age = now - float(status.get("at", 0))
        if age > 100 * beat_s:
            client.hdel(RELOAD_STATUS_KEY, name)
        elif age <= STALE_BEATS * beat_s:
            live[name] = status
    return live


def standing_of(client: redis.Redis, revision: str, beat_s: float, ttl_s: float,
              workers_before: set[str] = frozenset(),
              announcement: str | None = None) -> tuple[dict[str, str], int]:
    """Where each live worker and API process stands with `revision` ("done", "refused: why",
    "gone: …" for a worker of `workers_before` no longer consuming that had not taken it, or
    "pending: …"), and how many API processes report. `announcement`: its number (tasks/
    keys.py MODELS_ANNOUNCEMENTS_KEY); a worker's refusal of an earlier one is pending until
    it looked at this one (it begins a revision it refused again once announced again)."""
    statuses = _statuses(client, beat_s)
    consuming = {f"worker:{n}" for n in
                 client.zrangebyscore(CONSUMING_KEY, time.time() - ttl_s, "+inf")}
    names = consuming | set(workers_before) | {n for n in statuses if n.startswith("api:")}
    out = {}
    for name in sorted(names):
        status = statuses.get(name)
        if name.startswith("worker:") and name not in consuming and not (
                status and status.get("revision") == revision
                and status.get("state") == "serving"):
            # A worker that stopped during the reload (a crash, an operator; one whose new
            # child cannot load the new models rolls back instead, workers/reload.py) left
            # the consuming workers, and is not "done". (An API process is never among them:
            # it is pending until it reports the revision.)
            out[name] = "gone: stopped consuming during the reload (see its log)"
        elif status is None:
            out[name] = "pending: no report yet"
        elif status.get("refused") == revision or (status.get("error") and
                                                   status.get("revision") != revision):
            earlier = announcement is not None and status.get("announcement", announcement) \
                != announcement
            out[name] = "pending: not at this announcement yet" if earlier else \
                f"refused: {status['error']}"
        elif status["revision"] == revision and status["state"] == "serving":
            out[name] = "done"
        else:
            left, waiting = status.get("children_left"), status.get("waiting_for")
            out[name] = f"pending: {status['state']} ({status['revision']})" + \
                (f", {left} child(ren) to replace" if left else "") + \
                (f", its turn after worker:{waiting}'s" if waiting else "")
    # API processes handing over are pending until they exit, but not counted: the ones
    # that replace them are (a reload right after another starts while some still hand over).
    return out, sum(1 for n in names if n.startswith("api:")
                    and (statuses.get(n) or {}).get("state") != "handing over")


def wait(client: redis.Redis, revision: str, timeout_s: float, say: Callable[[str], None],
          settings: Settings, target: Path, workers_before: set[str], apis_before: int,
          announcement: str | None = None) -> Result:
    beat, ttl = settings.heartbeat_interval_s, settings.heartbeat_ttl_s
    deadline, shown, progress = time.monotonic() + timeout_s, {}, Progress(revision)
    while True:
        standing, apis = standing_of(client, revision, beat, ttl, workers_before, announcement)
        if progress.moved(_statuses(client, beat)):  # the timeout counts from now
            deadline = time.monotonic() + timeout_s
        for name, where in standing.items():
            if shown.get(name) != where:
                say(f"  {name}: {where}")
        shown = standing
        lines = [f"{n}: {w}" for n, w in standing.items()]
        failure = failed_load(client, revision)
        if failure:
            say(f"reload to {revision} refused: {failure}; the workers that took it roll "
                "back to the revision they served")
            return Result(REFUSED, revision, [*lines, failure], failed_load=True)
        pending = [n for n, w in standing.items() if w.startswith("pending")]
        if not pending and apis >= apis_before:
            refused = [n for n, w in standing.items() if w.startswith(("refused", "gone"))]
            if refused:
                say(f"reload to {revision} refused by {', '.join(refused)}")
                return Result(REFUSED, revision, lines)
            if not move_queued_jobs(client, settings, target, revision, say) or \
                    not fail_removed_jobs(client, settings, target, revision, say):
                return Result(REFUSED, revision, lines)
            say(f"reload done: every worker child and API process on revision {revision}")
            return Result(DONE, revision, lines)
        if time.monotonic() > deadline:
            say(f"reload to {revision} not done: nothing moved on for {timeout_s:g}s: "
                f"{', '.join(pending) or 'API processes not back'}")
            return Result(TIMED_OUT, revision, lines)
        time.sleep(min(0.5, beat))


def failed_load(client: redis.Redis, revision: str) -> str:
    """The failed load a worker's new pool child recorded for `revision`, said in one line
    ("" when none)."""
    failure = failure_of(client, revision)
    if not failure:
        return ""
    return f"worker:{failure.get('worker')} could not load it: {failure.get('error')}"


class Progress:
    """Whether the processes moved on to `revision` since the last look: one reached it for
    the first time, has fewer children left to replace than ever before, or is done. A
    status that merely changes (a worker in a restart loop: reloading, then serving the old
    revision, then reloading again) is not."""

    def __init__(self, revision: str) -> None:
        self.revision = revision
        self.least_left: dict[str, int] = {}  # process → the fewest children left it reported
        self.done: set[str] = set()

    def moved(self, statuses: dict[str, dict]) -> bool:
        moved = False
        for name, status in statuses.items():
            if status.get("revision") != self.revision or status.get("refused") == self.revision:
                continue
            left = int(status.get("children_left") or 0)
            if status.get("state") == "serving" and name not in self.done:
                self.done.add(name)
                moved = True
            if left < self.least_left.get(name, left + 1):
                self.least_left[name] = left
                moved = True
        return moved


