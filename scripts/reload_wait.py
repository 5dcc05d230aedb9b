"""Where the processes stand with an announced models file, for `make reload`
(scripts/reload.py) to wait on: each process's report (workers/batching/reload.py,
app/reloading.py), the consuming workers, a failed load a worker's new pool child recorded
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
from tasks.keys import CONSUMING_KEY, RELOAD_API_KEY, RELOAD_STATUS_KEY
from tasks.reload_failures import failed_where, failure_of

DONE, REFUSED, TIMED_OUT = 0, 2, 3
# A process's report older than this many heartbeats is a process that is gone.
STALE_BEATS = 5


@dataclass
class Result:
    status: int  # DONE, INVALID (scripts/reload.py), REFUSED or TIMED_OUT
    revision: str = ""
    lines: list[str] = field(default_factory=list)
    failed_load: bool = False  # a worker's new pool child could not load it
    refused: bool = False  # a process refused it (its canary failed, its file differs, …)


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


def live_reports(client: redis.Redis, beat_s: float) -> dict[str, dict]:
    """Each live process's report (where it stands, what it can serve: tasks/serves.py)."""
    return _statuses(client, beat_s)


def consuming_workers(client: redis.Redis, ttl_s: float) -> set[str]:
    """The workers consuming now on `client`'s Redis (a heartbeat in the last `ttl_s`), as
    their reports' fields (`worker:<node>`): a stopped worker's report outlives it a while."""
    return {f"worker:{n}" for n in
            client.zrangebyscore(CONSUMING_KEY, time.time() - ttl_s, "+inf")}


def standing_of(client: redis.Redis, revision: str, beat_s: float, ttl_s: float,
              workers_before: set[str] = frozenset(),
              announcement: str | None = None) -> tuple[dict[str, str], int]:
    """Where each live worker and API process stands with `revision` ("done", "refused: why",
    "gone: …" for a worker of `workers_before` no longer consuming that had not taken it, or
    "pending: …"), and how many API processes report. `announcement`: its number (tasks/
    keys.py MODELS_ANNOUNCEMENTS_KEY); a worker's refusal of an earlier one is pending until
    it looked at this one (it begins a revision it refused again once announced again)."""
    statuses = _statuses(client, beat_s)
    consuming = consuming_workers(client, ttl_s)
    names = consuming | set(workers_before) | {n for n in statuses if n.startswith("api:")}
    out = {}
    for name in sorted(names):
        status = statuses.get(name)
        if name.startswith("worker:") and name not in consuming and not (
                status and status.get("revision") == revision
                and status.get("state") == "serving"):
            # A worker that stopped during the reload (a crash, an operator; one whose new
            # child cannot load the new models rolls back instead, workers/batching/reload.py) left
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


def api_services(client: redis.Redis, beat_s: float) -> dict[str, int]:
    """The gunicorns serving the API (tasks/keys.py RELOAD_API_KEY) seen in the last 100
    heartbeats, and how many processes each runs; older ones are removed (a gunicorn
    stopped for good holds a reload that long at most)."""
    now, out = time.time(), {}
    for name, raw in client.hgetall(RELOAD_API_KEY).items():
        entry = orjson.loads(raw)
        if now - float(entry.get("at", 0)) > 100 * beat_s:
            client.hdel(RELOAD_API_KEY, name)
        else:
            out[name] = int(entry.get("processes") or 1)
    return out


def unready_apis(client: redis.Redis, revision: str, beat_s: float) -> dict[str, str]:
    """Each gunicorn where fewer processes serve `revision` than it runs: "api <host>
    <address>" → how many do. An API process that reports serving it has built its app from
    the file and reached its Redis; one restarting, or not up yet, is not counted."""
    statuses = _statuses(client, beat_s)
    out = {}
    for service, processes in api_services(client, beat_s).items():
        ready = sum(1 for name, status in statuses.items() if name.startswith("api:")
                    and status.get("service") == service and status.get("revision") == revision
                    and status.get("state") == "serving")
        if ready < processes:
            out[f"api {service}"] = f"pending: {ready} of {processes} process(es) up on it"
    return out


def wait(client: redis.Redis, revision: str, timeout_s: float, say: Callable[[str], None],
          settings: Settings, target: Path, workers_before: set[str], apis_before: int,
          announcement: str | None = None, removed_before: int | None = None,
          needs_worker: str = "") -> Result:
    """`needs_worker`: this Redis is a group's that models name (its name): done only once
    a worker serves there (none there, its models' jobs would wait for ever)."""
    beat, ttl = settings.heartbeat_interval_s, settings.heartbeat_ttl_s
    deadline, shown, progress = time.monotonic() + timeout_s, {}, Progress(revision)
    unanswered, stall = False, Stall(ttl, max(beat, 1.0))
    restarts = Restarts(client, min(timeout_s, RESTART_TTLS * ttl), workers_before)
    while True:
        began = time.monotonic()
        try:
            standing, apis = stall.excused(began, standing_of(
                client, revision, beat, ttl, workers_before, announcement))
            standing = restarts.awaited(standing)
        except redis.RedisError as exc:  # a frozen Redis: said once, the timeout holds
            if not unanswered:
                say(f"  Redis does not answer ({exc}); still waiting")
            unanswered, stall.at = True, time.monotonic()
            if time.monotonic() > deadline:
                say(f"reload to {revision} not done: Redis did not answer for {timeout_s:g}s")
                return Result(TIMED_OUT, revision, [f"Redis: {exc}"])
            time.sleep(min(0.5, beat))
            continue
        unanswered = False
        if not any(w.startswith(("refused", "gone")) for w in standing.values()):
            standing.update(unready_apis(client, revision, beat))
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
            return _settled(client, revision, standing, say, settings, target,
                            removed_before, needs_worker)
        if time.monotonic() > deadline:
            say(f"reload to {revision} not done: nothing moved on for {timeout_s:g}s: "
                + ("; ".join(f"{n} ({standing[n]})" for n in pending)
                   or "API processes not back"))
            return Result(TIMED_OUT, revision, lines)
        time.sleep(min(0.5, beat))


def _settled(client: redis.Redis, revision: str, standing: dict[str, str],
             say: Callable[[str], None], settings: Settings, target: Path,
             removed_before: int | None, needs_worker: str) -> Result:
    """Every process done, refused or gone: refused, or the queued jobs of moved queues
    moved and of removed models failed, and done."""
    lines = [f"{n}: {w}" for n, w in standing.items()]
    refused = [n for n, w in standing.items() if w.startswith(("refused", "gone"))]
    if needs_worker and not any(n.startswith("worker:") for n in standing):
        say(f"reload to {revision} refused: no worker runs on group {needs_worker!r}, "
            "whose models' jobs would wait there for ever")
        return Result(REFUSED, revision, lines, refused=True)
    if refused:
        say(f"reload to {revision} refused by {', '.join(refused)}")
        return Result(REFUSED, revision, lines, refused=True)
    if not move_queued_jobs(client, settings, target, revision, say) or \
            not fail_removed_jobs(client, settings, target, revision, say, removed_before):
        return Result(REFUSED, revision, lines)
    say(f"reload done: every worker child and API process on revision {revision}")
    return Result(DONE, revision, lines)


# How long a worker that stopped consuming during a reload is awaited back under a new name (its
# keeper starts it again: make run names a worker by its pid), in heartbeat TTLs.
RESTART_TTLS = 3


class Restarts:
    """A worker that stopped consuming during the reload (a SIGKILL, a crash) is started again
    by its keeper under a new node name (`worker-<pid>@<host>`, scripts/worker.sh); it reads
    the models file on disk, the new one, as it starts. Such a worker, on the same host and
    consuming the same queues, and not there when the reload began (or started after the
    stopped one last reported: killed moments before the reload), takes the stopped one's
    place: the stopped one is "restarted as" it, and the reload waits for the new one to
    serve the revision, as for any other. Until one comes, for `grace_s` (and within the
    reload's timeout), the stopped worker is awaited; then it is gone, as before (the reload
    refused, and undone with FILE). Before, it was gone at once, and a reload under a keeper
    that restarted the worker in a second was refused."""

    AWAITED = "pending: stopped consuming during the reload; awaited back (its keeper " \
        "starting it again: a new worker on its host and queues)"

    def __init__(self, client: redis.Redis, grace_s: float, workers_before: set[str]) -> None:
        self.client, self.grace_s, self.before = client, grace_s, workers_before
        self.since: dict[str, float] = {}  # a stopped worker → when it was first seen so
        self.reports: dict[str, dict | None] = {}  # a stopped worker's last report

    def awaited(self, standing: dict[str, str]) -> dict[str, str]:
        gone = [n for n, w in standing.items() if w.startswith("gone") and n.startswith("worker:")]
        if not gone:
            return standing
        standing, now = dict(standing), time.monotonic()
        taken: set[str] = set()
        for name in gone:
            self.since.setdefault(name, now)
            successor = self._successor(name, standing, taken)
            if successor:
                taken.add(successor)
                standing[name] = f"restarted as {successor}"
            elif now - self.since[name] < self.grace_s:
                standing[name] = self.AWAITED
        return standing

    def _successor(self, name: str, standing: dict[str, str], taken: set[str]) -> str:
        """A live worker on `name`'s host with its queues that was not there when the reload
        began, or started after the stopped one last reported (the stopped one's last report
        read once): a worker killed moments before the reload is still among the consuming
        ones when it begins (its heartbeat within its TTL), and so can be the one its keeper
        started again."""
        if name not in self.reports:
            raw = self.client.hget(RELOAD_STATUS_KEY, name)
            self.reports[name] = orjson.loads(raw) if raw else None
        report = self.reports[name]
        if report is None:
            return ""
        host = name.split("@", 1)[-1]
        for other in sorted(standing):
            if other in taken or not other.startswith("worker:") or \
                    other.split("@", 1)[-1] != host or standing[other].startswith("gone"):
                continue
            raw = self.client.hget(RELOAD_STATUS_KEY, other)
            found = orjson.loads(raw) if raw else None
            if found and _consumes(found) == _consumes(report) and (
                    other not in self.before or _started_after(found, report)):
                return other
        return ""


def _started_after(found: dict, report: dict) -> bool:
    """Whether the worker of `found` started after the one of `report` last reported (both
    on one host: one clock). A worker that does not say when it started did not."""
    return float(found.get("started") or 0) > float(report.get("at") or 0)


def _consumes(report: dict) -> tuple:
    """What a worker consumes: every model's queues (those of the file it read: they change
    with the reload), or the ones it was given."""
    return ("every model's",) if report.get("consumes_all") else \
        tuple(sorted(report.get("queues") or ()))


class Stall:
    """When Redis last did not answer, or answered slower than `slow_s` (a freeze, a stall):
    for `ttl_s` after, a worker whose heartbeat lapsed meanwhile is not concluded gone, but
    awaited (its heartbeat comes back once Redis answers it), within the reload's deadline.
    A freeze of ~10 s once made a good reload look refused, and undone: every consuming entry
    had lapsed by the time Redis answered again, before any worker could renew its own."""

    AWAITED = "pending: its heartbeat lapsed while Redis did not answer; awaited"

    def __init__(self, ttl_s: float, slow_s: float) -> None:
        self.ttl_s, self.slow_s = ttl_s, slow_s
        self.at: float | None = None  # when Redis last stalled (time.monotonic())

    def excused(self, began: float, found: tuple[dict[str, str], int]
                ) -> tuple[dict[str, str], int]:
        """`standing_of`'s answer to a look that began at `began`, a lapse excused."""
        now = time.monotonic()
        if now - began > self.slow_s:
            self.at = now
        standing, apis = found
        if self.at is None or now - self.at > self.ttl_s:
            return standing, apis
        return {n: self.AWAITED if w.startswith("gone") else w
                for n, w in standing.items()}, apis


def failed_load(client: redis.Redis, revision: str) -> str:
    """The failed load a worker's new pool child recorded for `revision`, said in one line
    ("" when none)."""
    failure = failure_of(client, revision)
    if not failure:
        return ""
    return f"{failed_where(failure)} could not load it: {failure.get('error')}"


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


