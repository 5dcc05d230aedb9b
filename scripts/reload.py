"""`make reload` (`python -m scripts.reload [FILE]`): the models file taken up by every running
process, without a restart.

1. The file is checked as every process would read it (config/models.py), its model files must
   exist and be the operator's alone (scripts/preflight.py). A file that fails changes nothing:
   the reason is printed and the exit status is 1. With FILE, FILE is checked and then
   installed in place of the models file the processes read (IQ_MODELS_FILE), atomically; the
   file it replaces is kept beside it as `<name>.previous`, so that a rollback is
   `make reload FILE=config/models.yaml.previous`.
2. Its revision (a hash of its bytes) is announced in Redis. Each worker takes the new file in
   its main process and replaces its pool children one at a time, each after its batch
   (workers/reload.py); each API process has its gunicorn reload gracefully (app/reloading.py).
   A process whose own file is not the announced one keeps serving and reports why.
3. It waits until every live worker and API process serves the new revision ("reload done":
   exit 0), one refused or a worker stopped before it took the new file (2: a worker whose
   new pool child cannot load the new models stops) or `--timeout` passed with no process
   moving on (3), saying where each one stands. The workers that serve a queue reload in
   turn (workers/turns.py), one model load after another: the timeout bounds a stall, not
   the whole roll, so that it need not grow with the number of workers.
4. Once done, the jobs still queued for a model the file does not have (removed now or by an
   earlier reload) end `failed` with `model_removed`, however many workers consumed its queue
   (scripts/reload_removed.py); it says how many. (Exit 2 when Redis refused that: the next
   reload fails them.)
5. With Redis groups (IQ_REDIS_GROUPS), 2 to 4 again on each group's Redis in turn, where its
   workers watch and report: the reload is done when every group's is.

`reload()` does the same from Python, for scripts that reload and wait.
"""
from __future__ import annotations

import argparse
import fcntl
import importlib.util
import os
import shutil
import sys
import time
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping

import orjson
import redis

from config import ConfigError, Settings, load_settings
from config.groups import check_model_groups
from config.models import TENSOR_KINDS, parse_models, revision_of
from scripts.preflight import model_file_problems
from scripts.reload_removed import fail_removed_jobs
from tasks.keys import CONSUMING_KEY, MODELS_REVISION_KEY, RELOAD_STATUS_KEY
from tasks.redis_client import connect

DONE, INVALID, REFUSED, TIMED_OUT = 0, 1, 2, 3
# A process's report older than this many heartbeats is a process that is gone.
STALE_BEATS = 5


class Invalid(Exception):
    """The new models file cannot be used; the message says why. Nothing was changed."""


@dataclass
class Result:
    status: int  # DONE, INVALID, REFUSED or TIMED_OUT
    revision: str = ""
    lines: list[str] = field(default_factory=list)


def _unloadable(spec) -> str | None:
    """Why a worker's pool child could not even open the model's file or folder, or None.
    A child that cannot load its models stops its worker (workers/main.py), and a reload
    replaces every worker's children: a file it cannot open would stop every worker. The
    tensor kinds' files (TorchScript `.pt`, torch.export `.pt2`) are zip archives, so a
    truncated or garbage file is seen here without loading it."""
    path = Path(spec.path)
    if not path.exists():
        return f"{spec.path} does not exist"
    if spec.kind in TENSOR_KINDS or spec.kind == "image":
        if not path.is_file():
            return f"{spec.path} is not a file"
        try:
            with path.open("rb") as fh:
                if not zipfile.is_zipfile(fh):
                    return f"{spec.path} is not a TorchScript or torch.export archive " \
                           "(truncated or corrupt?)"
        except OSError as exc:
            return f"{spec.path} cannot be read: {exc.strerror or exc}"
    elif path.is_dir():
        try:
            next(os.scandir(path), None)
        except OSError as exc:
            return f"{spec.path} cannot be read: {exc.strerror or exc}"
    else:
        try:
            path.open("rb").close()
        except OSError as exc:
            return f"{spec.path} cannot be read: {exc.strerror or exc}"
    return None


def _missing_files(target: Path, content: bytes, groups: Mapping[str, str]) -> list[str]:
    problems = []
    models = parse_models(target, content)
    check_model_groups(models, groups)  # a Redis group the settings lack: ConfigError
    for spec in models.values():
        why = _unloadable(spec) if spec.path else None
        if why:
            problems.append(f"models.{spec.name}: {why}")
        if spec.package and importlib.util.find_spec(spec.package) is None:
            problems.append(f"models.{spec.name}: package {spec.package} is not installed")
    return problems


def install(target: Path, source: Path | None, groups: Mapping[str, str] | None = None) -> str:
    """Check `source` (default: `target` itself) as the models file at `target` and put it
    there; its revision. `groups`: the Redis groups its models may name. Raises Invalid,
    changing nothing."""
    try:
        content = (source or target).read_bytes()
        problems = _missing_files(target, content, groups or {})
    except (OSError, ConfigError) as exc:
        raise Invalid(str(exc)) from None
    if source is None or source.resolve() == target.resolve():
        problems += model_file_problems(str(target))
        if problems:
            raise Invalid("\n".join(problems))
        return revision_of(content)
    # Checked where it will be read from (relative paths start at its folder), then moved
    # into place in one rename.
    staged = target.with_name(f".{target.name}.{os.getpid()}")
    staged.write_bytes(content)
    try:
        problems += model_file_problems(str(staged))
        if problems:
            raise Invalid("\n".join(problems))
        if target.exists():
            shutil.copy2(target, target.with_name(target.name + ".previous"))
        os.replace(staged, target)
    finally:
        staged.unlink(missing_ok=True)
    return revision_of(content)


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


def _standing(client: redis.Redis, revision: str, beat_s: float, ttl_s: float,
              workers_before: set[str] = frozenset()) -> tuple[dict[str, str], int]:
    """Where each live worker and API process stands with `revision` ("done", "refused: why",
    "gone: …" for a worker of `workers_before` no longer consuming that had not taken it, or
    "pending: …"), and how many API processes report."""
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
            # A worker whose new pool child could not load the new models stops (workers/
            # main.py): it leaves the consuming workers, and is not "done". (An API process
            # is never among them: it is pending until it reports the revision.)
            out[name] = "gone: stopped consuming during the reload (see its log)"
        elif status is None:
            out[name] = "pending: no report yet"
        elif status.get("refused") == revision or (status.get("error") and
                                                   status.get("revision") != revision):
            out[name] = f"refused: {status['error']}"
        elif status["revision"] == revision and status["state"] == "serving":
            out[name] = "done"
        else:
            left, waiting = status.get("children_left"), status.get("waiting_for")
            out[name] = f"pending: {status['state']} ({status['revision']})" + \
                (f", {left} child(ren) to replace" if left else "") + \
                (f", its turn after worker:{waiting}'s" if waiting else "")
    return out, sum(1 for n in names if n.startswith("api:"))


def reload(source: str | Path | None = None, *, timeout_s: float = 600,
           say: Callable[[str], None] = print, redis_url: str | None = None,
           settings: Settings | None = None) -> Result:
    """Check and install the models file (`source`, or the one in place), announce it, and
    wait for every live worker and API process to serve it (see the module's docstring).
    Redis is reached as every process reaches it: through the sentinels when there are some
    (the primary they name, with `redis_url`'s credentials)."""
    settings = settings or load_settings()
    target = Path(settings.models_file)
    try:
        lock = _only_reload(target)
    except Invalid as exc:
        say(f"reload refused, nothing changed: {exc}")
        return Result(INVALID, lines=[str(exc)])
    try:
        result = _reload(target, source, lock, timeout_s, say, redis_url, settings)
        # Each Redis group's workers watch their own Redis: announced there too, in turn,
        # the file installed above reloaded as it is.
        for name, url in settings.redis_group_urls.items():
            if result.status != DONE:
                break
            say(f"Redis group {name}:")
            result = _reload(target, None, lock, timeout_s, say, None,
                             replace(settings, redis_url=url, redis_sentinels=""))
        return result
    finally:
        os.close(lock)


def _only_reload(target: Path) -> int:
    """A lock (a descriptor to close) that this is the only reload of `target` running.
    Two at once would each install their file, the second one's `.previous` being the
    first's, then announce: one of them waited its whole timeout for a revision no longer
    on disk (or every process refused the last announced, when that one lost the install)."""
    path = target.with_name(f".{target.name}.reload-lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise Invalid(f"cannot take the reload lock {path}: {exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise Invalid(f"another reload of {target} is running; run this one after it "
                      "is done") from None
    return fd


def _reload(target: Path, source: str | Path | None, lock: int, timeout_s: float,
            say: Callable[[str], None], redis_url: str | None, settings: Settings) -> Result:
    try:
        revision = install(target, Path(source) if source else None,
                           settings.redis_group_urls)
    except Invalid as exc:
        say(f"reload refused, nothing changed: {exc}")
        return Result(INVALID, lines=[str(exc)])
    client = connect(redis_url or settings.redis_url, settings)
    beat, ttl = settings.heartbeat_interval_s, settings.heartbeat_ttl_s
    before, apis_before = _standing(client, revision, beat, ttl)
    workers_before = {n for n in before if n.startswith("worker:")}
    client.set(MODELS_REVISION_KEY, revision)
    say(f"models file {target} revision {revision} announced")
    deadline, shown = time.monotonic() + timeout_s, {}
    while True:
        standing, apis = _standing(client, revision, beat, ttl, workers_before)
        if standing != shown:  # a process moved on: the timeout counts from now
            deadline = time.monotonic() + timeout_s
        for name, where in standing.items():
            if shown.get(name) != where:
                say(f"  {name}: {where}")
        shown = standing
        lines = [f"{n}: {w}" for n, w in standing.items()]
        pending = [n for n, w in standing.items() if w.startswith("pending")]
        if not pending and apis >= apis_before:
            refused = [n for n, w in standing.items() if w.startswith(("refused", "gone"))]
            if refused:
                say(f"reload to {revision} refused by {', '.join(refused)}")
                return Result(REFUSED, revision, lines)
            if not fail_removed_jobs(client, settings, target, revision, say):
                return Result(REFUSED, revision, lines)
            say(f"reload done: every worker child and API process on revision {revision}")
            return Result(DONE, revision, lines)
        if time.monotonic() > deadline:
            say(f"reload to {revision} not done: nothing moved on for {timeout_s:g}s: "
                f"{', '.join(pending) or 'API processes not back'}")
            return Result(TIMED_OUT, revision, lines)
        time.sleep(min(0.5, beat))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make reload", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", help="a models file to check and install in place "
                        "of the one the processes read (default: reload that one as it is)")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds to wait with no process moving on to the new file "
                        "(default 600)")
    args = parser.parse_args(argv)
    from scripts.run import own_redis_env

    try:
        env = dict(os.environ)
        env.update(own_redis_env(env))  # make run's own Redis, replicated or not
        return reload(args.file, timeout_s=args.timeout,
                      settings=load_settings(environ=env)).status
    except ConfigError as exc:
        print(f"make reload: {exc}", file=sys.stderr)
        return INVALID
    except redis.RedisError as exc:
        print(f"make reload: Redis: {exc}", file=sys.stderr)
        return REFUSED


if __name__ == "__main__":
    sys.exit(main())
