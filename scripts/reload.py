"""`make reload` (`python -m scripts.reload [FILE]`): the models file taken up by every running
process, without a restart.

1. The file is checked as every process would read it (config/models.py), its model files must
   exist and be the operator's alone (scripts/preflight.py), and every live process must be
   able to serve it by what it reported (its Redis groups; a worker's GPUs: tasks/serves.py),
   whatever this shell's environment says. A file that fails changes nothing: the reason is
   printed and the exit status is 1. With FILE, FILE is checked and then
   installed in place of the models file the processes read (IQ_MODELS_FILE), atomically; the
   file it replaces is kept beside it as `<name>.previous`, so that a rollback is
   `make reload FILE=config/models.yaml.previous`. Each is written to a file of its own first
   (mkstemp), never through a link, with the mode and owner of the file replaced (`install`).
   The settings file (IQ_CONFIG) and the API keys file, which the API processes read again
   when they reload, are checked as the models file is (scripts/preflight.py).
2. Its revision (a hash of its bytes) is announced in Redis. Each worker takes the new file in
   its main process and replaces its pool children one at a time, each after its batch
   (workers/batching/reload.py); each API process has its gunicorn reload gracefully once a canary
   of the file started (app/reloading.py, app/canary.py), else refuses it. A process whose own file
   is not the announced one keeps serving and reports why. Announcements are numbered: a worker
   that refused a revision tries it again when it is announced again (its host fixed).
3. It waits until every live worker and API process serves the new revision and every
   gunicorn runs as many processes on it as it runs ("reload done": exit 0; with FILE, a
   refusal puts the previous file back as in a failed load below), one refused or a worker
   stopped before it took the new file (2: one started again by its keeper under a new name,
   on its host and queues, within three heartbeat TTLs takes its place and is waited for
   instead, scripts/reload_wait.py `Restarts`), or `--timeout`
   passed with no process moving on (3: moving on is a process reaching the new revision,
   replacing a child or finishing; a status that merely changes, as a worker's in a restart
   loop, is not), saying where each one stands. The workers that serve a queue reload in
   turn (workers/batching/turns.py), one model load after another: the timeout bounds a stall, not
   the whole roll, so that it need not grow with the number of workers. A new pool child
   that cannot load the new models (a file that passes the check in 1 but is no program)
   halts the roll: that worker and any still reloading roll back to the revision they
   served, the others refuse it (workers/batching/reload.py), and this exits 2 with the failing
   worker and its error. With FILE, it first puts the file it replaced back in place and
   announces it, so that the API processes (which took the new file at once) and the file on
   disk are back on the revision the workers serve; the failed file is kept as
   `<name>.failed` (`<name>.previous` as it was). Announcing a revision clears such a
   failure first, so that the same file may be reloaded again once its host is fixed.
   A Redis that stops answering once the file is installed puts the file it replaced back
   the same way (exit 2, one line: nothing changed).
4. Once done, the jobs still queued for a model the file does not have (removed now or by an
   earlier reload) end `failed` with `model_removed`, however many workers consumed its queue
   (scripts/reload_removed.py); it says how many, and how many ended so in all since the
   announcement (the workers fail most as they meet them: tasks/keys.py REMOVED_FAILED_KEY).
   (Exit 2 when Redis refused that: the next reload fails them.)
5. With Redis groups (IQ_REDIS_GROUPS), 2 to 4 on each group's Redis in turn, where its
   workers watch and report, and then on REDIS_URL's (where the API processes watch: they
   take the file only once the workers of each group its models are on serve it): the
   reload is done when every one is.
Every Redis the new file's models are on must have a worker reporting: with none (none
running, or none consuming yet), it waits up to `--timeout` for one, then refuses, nothing
changed (1).

`reload()` does the same from Python, for scripts that reload and wait.
"""
from __future__ import annotations

import os
import signal
import sys


def _interrupted_loading(_sig, _frame) -> None:
    print("make reload: interrupted before it read anything; nothing was changed",
          file=sys.stderr, flush=True)
    # Not SystemExit: raised while the import machinery runs a callback (a module lock's,
    # freed), it is printed as ignored and the reload goes on (seen in CI). Nothing has been
    # read or changed yet: there is nothing to undo.
    os._exit(130)


if __name__ == "__main__":
    # A Ctrl-C while the imports below load (seconds on a loaded host) is said in one line as
    # well: nothing has been read or changed yet. main() hands Ctrl-C back to its own handling.
    signal.signal(signal.SIGINT, _interrupted_loading)

import argparse
import fcntl
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping

import redis

from config import ConfigError, Settings, load_settings
from config.models import parse_models, revision_of
from scripts.models_as_user import kinds_as_worker
from scripts.models_check import problems_of
from scripts.preflight import model_file_problems, operator_file_problems
from scripts.reload_wait import DONE, REFUSED, TIMED_OUT, Result, consuming_workers, \
    live_reports, standing_of, wait
from scripts.run_users import reload_problems
from scripts.staging import put_in_place, replaced_problems, staged_beside
from tasks.keys import MODELS_ANNOUNCEMENTS_KEY, MODELS_REVISION_KEY, REMOVED_FAILED_KEY, \
    reload_failed_key
from tasks.queuemoves import QueueMoves
from tasks.redis_client import connect
from tasks.serves import unconsumed
from workers.child.devices import visible_gpu_count

INVALID = 1
# The longest one Redis call of a reload may take (a frozen Redis is said at once).
_ANSWER_S = 5.0
__all__ = ["DONE", "INVALID", "REFUSED", "TIMED_OUT", "Result", "install", "main", "reload"]


class Invalid(Exception):
    """The new models file cannot be used; the message says why. Nothing was changed."""


def install(target: Path, source: Path | None, groups: Mapping[str, str] | None = None,
            reports: Mapping[str, dict] | None = None,
            waiting: Callable[[str, str], int] | None = None, *,
            host_gpus: int | None = None) -> str:
    """Check `source` (default: `target` itself) as the models file at `target` and put it
    there; its revision. `groups`: the Redis groups its models may name; `reports`: what each
    live process said it can serve (tasks/serves.py). Raises Invalid, changing nothing.
    Nothing is written through a link (scripts/staging.py): another local user may plant one
    under a name in a sticky folder (/tmp), and a link of theirs at `target` or
    `<name>.previous`, or a file of theirs, is refused."""
    try:
        content = (source or target).read_bytes()
        # The models it replaces: one moved to another Redis group with jobs waiting on the
        # old one is refused (scripts/models_check.py). (Reloaded in place, the file the
        # processes took is gone: only a FILE is compared.)
        before = parse_models(target, target.read_bytes()) \
            if waiting and source is not None and target.exists() else None
        problems = problems_of(target, content, groups or {}, reports, before, waiting,
                               host_gpus=host_gpus)
    except (OSError, ConfigError) as exc:
        raise Invalid(str(exc)) from None
    if source is None or source.resolve() == target.resolve():
        problems += model_file_problems(str(target))
        if problems:
            raise Invalid("\n".join(problems))
        return revision_of(content)
    previous = target.with_name(target.name + ".previous")
    problems += replaced_problems(target, previous)
    if problems:
        raise Invalid("\n".join(problems))
    try:
        old = target.read_bytes() if target.exists() else None
        # Checked where it will be read from (relative paths start at its folder), then moved
        # into place in one rename.
        staged = staged_beside(target, content, target if old is not None else source,
                               private=old is None)
    except OSError as exc:
        raise Invalid(f"cannot stage {target}: {exc}") from None
    try:
        problems += model_file_problems(str(staged))
        if problems:
            raise Invalid("\n".join(problems))
        put_in_place(staged, target, previous, old)
    except OSError as exc:
        raise Invalid(f"cannot install {target}: {exc}") from None
    finally:
        staged.unlink(missing_ok=True)
    return revision_of(content)


def reload(source: str | Path | None = None, *, timeout_s: float = 600,
           say: Callable[[str], None] = print, redis_url: str | None = None,
           settings: Settings | None = None) -> Result:
    """Check and install the models file (`source`, or the one in place), announce it, and
    wait for every live worker and API process to serve it (see the module's docstring).
    Redis is reached as every process reaches it: through the sentinels when there are some
    (the primary they name, with `redis_url`'s credentials)."""
    settings = settings or load_settings()
    # With IQ_RUN_USERS=separate as root: the file's `kinds:` modules imported by a process
    # of the worker's user, never here (scripts/models_as_user.py).
    with kinds_as_worker(settings):
        return _reload(source, timeout_s, say, redis_url, settings)


def _reload(source: str | Path | None, timeout_s: float, say: Callable[[str], None],
            redis_url: str | None, settings: Settings) -> Result:
    target = Path(settings.models_file)
    lock = _checked_alone_and_locked(target, source, settings, say)
    if isinstance(lock, Result):
        return lock
    try:
        redises = _redises(settings, redis_url, min(_ANSWER_S, timeout_s))
        try:
            # The API processes a reload restarts read both again (app/reloading.py).
            refused = operator_file_problems(os.environ.get("IQ_CONFIG", ""),
                                             settings.api_keys_file)
            # With IQ_RUN_USERS=separate, what root reads here each part's user must too.
            refused += reload_problems(settings, target, Path(source) if source else None)
            if refused:
                raise Invalid("\n".join(refused))
            reports, by_group = _reports(redises, target, Path(source) if source else target,
                                         timeout_s, say)
        except redis.RedisError as exc:  # REDIS_URL's: nothing could be announced either
            say(f"reload refused, nothing changed: Redis did not answer ({exc})")
            return Result(REFUSED, lines=[str(exc)])
        except Invalid as exc:
            say(f"reload refused, nothing changed: {exc}")
            return Result(INVALID, lines=str(exc).splitlines())
        previous = target.with_name(target.name + ".previous")
        try:
            # What `.previous` holds now: kept there when this reload is undone (the last
            # good file before the one in place, for the documented rollback, docs/deploying.md).
            kept = previous.read_bytes() if source is not None and previous.is_file() \
                and not previous.is_symlink() else None
            if unconsumed := consumers_problems(target, Path(source) if source else target,
                                                by_group, reports):
                raise Invalid("\n".join(unconsumed))
            revision = install(target, Path(source) if source else None,
                               settings.redis_group_urls, reports, _waiting(redises, say),
                               host_gpus=None if any(n.startswith("worker:") for n in reports)
                               else visible_gpu_count(settings))
        except (OSError, Invalid) as exc:
            say(f"reload refused, nothing changed: {exc}")
            return Result(INVALID, lines=[str(exc)])
        reached = 0
        try:
            for reached, (name, client, group) in enumerate(redises, 1):
                result = _announce(client, target, revision, timeout_s, say, group, name)
                if result.status != DONE:
                    break
        except redis.RedisError as exc:
            return _unannounced(target, source, revision, redises[:reached], exc, timeout_s,
                                say, settings, kept)
        if (result.failed_load or result.refused) and source is not None:
            return _undo(target, result, redises[:reached], timeout_s, say, settings, kept)
        return result
    finally:
        os.close(lock)


def _checked_alone_and_locked(target: Path, source: str | Path | None, settings: Settings,
                              say: Callable[[str], None]) -> int | Result:
    """The reload lock (a descriptor to close), or the refusal. The file is checked alone
    before the lock is taken: one that cannot parse, names a group the settings lack or a
    file that is missing never holds up a good reload started beside it."""
    try:
        content = Path(source or target).read_bytes()
        lines = problems_of(target, content, settings.redis_group_urls)
        if not lines:
            return _only_reload(target)
    except (OSError, ConfigError, Invalid) as exc:
        lines = [str(exc)]
    say("reload refused, nothing changed: " + "\n".join(lines))
    return Result(INVALID, lines=lines)


def _redises(settings: Settings, redis_url: str | None, answer_s: float) -> list:
    """(group name, client, its settings) of each group's Redis, then REDIS_URL's: each
    group's workers watch their own Redis, so a reload is announced there too, in turn, and
    there first: the API processes watch REDIS_URL's, and take the file only once the workers
    of every group its models are on serve it (app/reloading.py). Each call is bounded by
    `answer_s` (a frozen Redis is said within seconds, and --timeout holds)."""
    redises = []
    for name, url in settings.redis_group_urls.items():
        group = replace(settings, redis_url=url, redis_sentinels="")
        redises.append((name, connect(url, group, deadline_s=answer_s), group))
    return [*redises, ("", connect(redis_url or settings.redis_url, settings,
                                   deadline_s=answer_s), settings)]


def _reports(redises: list, target: Path, source: Path, timeout_s: float,
             say: Callable[[str], None]) -> tuple[dict[str, dict], dict[str, dict[str, dict]]]:
    """`_live_reports`, once a worker reports on each Redis the new file's models are on
    ("" REDIS_URL's, or a group's): with none there (none runs, or none consumes yet) no
    worker could be asked whether it serves the file, nor would one take it. It waits for
    one up to `timeout_s` (a worker starting, or restarted by its keeper), saying so at once;
    then Invalid, nothing changed."""
    reports, by_group = _live_reports(redises, say)
    try:
        needed = {spec.redis for spec in parse_models(target, source.read_bytes()).values()}
    except (OSError, ConfigError):
        return reports, by_group  # said by install's check

    clients = {name: (client, group) for name, client, group in redises}

    def serving(name: str) -> bool:
        """Whether a worker reports on that Redis, and consumes there (a stopped one's
        report outlives it a while)."""
        client, group = clients[name]
        try:
            return bool(consuming_workers(client, group.heartbeat_ttl_s) & by_group[name].keys())
        except redis.RedisError:
            if not name:
                raise
            return True  # a group's Redis that does not answer: said when it is announced

    def lacking() -> str:
        """Where none serves; a group that could not be read, is not configured here or
        in a live process: said by the checks that follow, naming the field."""
        return ", ".join("REDIS_URL's Redis" if not g else f"group {g}'s Redis"
                         for g in sorted(needed) if g in by_group and not any(
                             "groups" in r and g and g not in r["groups"]
                             for r in reports.values()) and not serving(g))

    missing, deadline = lacking(), time.monotonic() + timeout_s
    if missing:
        say(f"no worker reports on {missing} (none runs, or none consumes yet): waiting up "
            f"to {timeout_s:g}s for one")
    while missing and time.monotonic() < deadline:
        time.sleep(0.5)
        reports, by_group = _live_reports(redises, lambda line: None)
        missing = lacking()
    if missing:
        raise Invalid(f"no worker reports on {missing} after {timeout_s:g}s: a reload is "
                      "checked against the workers that would serve its models, and taken up "
                      "by them first; start one (make run) and reload again")
    return reports, by_group


def _live_reports(redises: list, say: Callable[[str], None]
                  ) -> tuple[dict[str, dict], dict[str, dict[str, dict]]]:
    """What each live process reports it can serve, on every Redis, all together and by
    group: a file is checked against their environment, not this shell's, before anything
    changes. REDIS_URL's Redis not answering raises; a group's is said and left out."""
    reports: dict[str, dict] = {}
    by_group: dict[str, dict[str, dict]] = {}
    for name, client, group in redises:
        try:
            by_group[name] = live_reports(client, group.heartbeat_interval_s)
            reports.update(by_group[name])
        except redis.RedisError as exc:
            if not name:
                raise
            say(f"Redis group {name}: its processes' reports could not be read ({exc})")
    return reports, by_group


def _waiting(redises: list, say: Callable[[str], None]) -> Callable[[str, str], int]:
    """How many jobs wait on a queue of a Redis group ("": REDIS_URL's), for the check of a
    model moved to another group (scripts/models_check.py `stranded`)."""
    clients = {name: client for name, client, _ in redises}

    def waiting(group: str, queue: str) -> int:
        try:
            return QueueMoves(clients[group]).waiting([queue])[queue] if group in clients else 0
        except redis.RedisError as exc:  # moving a model off a Redis that is gone
            say(f"Redis group {group}: its jobs waiting on {queue} could not be counted ({exc})")
            return 0
    return waiting


def _only_reload(target: Path) -> int:
    """A lock (a descriptor to close) that this is the only reload of `target` running.
    Two at once would each install their file, the second one's `.previous` being the
    first's, then announce: one of them waited its whole timeout for a revision no longer
    on disk (or every process refused the last announced, when that one lost the install)."""
    path = target.with_name(f".{target.name}.reload-lock")
    try:  # never through a link another user planted there (it would make their file)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise Invalid(f"cannot take the reload lock {path}: {exc}") from None
    owner = os.fstat(fd).st_uid
    if owner not in (0, os.getuid()):  # theirs to hold: every reload refused
        os.close(fd)
        raise Invalid(f"the reload lock {path} is owned by another user (uid {owner}); "
                      "delete it") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise Invalid(f"another reload of {target} is running; run this one after it "
                      "is done") from None
    return fd


def _undo(target: Path, result: Result, announced: list, timeout_s: float,
          say: Callable[[str], None], settings: Settings, kept: bytes | None = None) -> Result:
    """A worker's new child could not load the file (on any Redis group's): the roll halted
    there and the workers rolled back. The file it replaced goes back in place, announced on
    every Redis the new one was, so that the API processes (which took the new file) and the
    file on disk are back where the workers are."""
    previous = target.with_name(target.name + ".previous")
    try:
        back = install(target, previous, settings.redis_group_urls)
    except Invalid as exc:
        say(f"the previous models file could not be put back ({exc}): fix {target} and "
            "reload it")
        return result
    failed = _set_aside(target, previous, kept, say)
    say(f"putting back the previous models file (revision {back}); the failed one is kept "
        f"as {failed}")
    lines, undone = list(result.lines), True
    for name, client, group in announced:
        undo = _announce(client, target, back, timeout_s, say, group, name)
        lines += undo.lines
        undone = undone and undo.status == DONE
    say(f"reload to {result.revision} refused, and undone: every process serves revision "
        f"{back}" if undone else f"reload to {result.revision} refused, and not undone "
        "everywhere (see above)")
    return replace(result, lines=lines)


def _set_aside(target: Path, previous: Path, kept: bytes | None,
               say: Callable[[str], None]) -> Path:
    """Once the file a failed reload replaced is back in place (`previous` then holds the
    failed one): the failed file kept as `<name>.failed`, `previous` as it was before the
    reload (`kept`; none when there was none), so that the rollback goes back to the last
    good change. Returns the `.failed` path."""
    failed = target.with_name(target.name + ".failed")
    try:
        _keep(target, failed, previous.read_bytes())
        if kept is not None:
            _keep(target, previous, kept)
        else:
            previous.unlink(missing_ok=True)
    except OSError as exc:
        say(f"could not keep the failed file as {failed}: {exc}")
    return failed


def _keep(target: Path, path: Path, content: bytes) -> None:
    """`content` at `path` beside the models file, written as install writes (never through
    a link), with the models file's mode."""
    staged = staged_beside(target, content, target)
    try:
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)


def consumers_problems(target: Path, source: Path, by_group: Mapping[str, dict[str, dict]],
                       reports: Mapping[str, dict] | None = None) -> list[str]:
    """One line per model, new or with a new queue or Redis group, whose queue no live worker
    on its Redis (its group's, "" the default's) would consume, by the workers' reports there
    (tasks/serves.py): its jobs would wait there for ever (a Redis with none at all:
    `_reports` waited for one). `reports`: every live process's, by field."""
    try:
        models = parse_models(target, source.read_bytes())
        now = parse_models(target, target.read_bytes()) if target.exists() else {}
    except (OSError, ConfigError):
        return []  # said by install's check
    # Only what this reload changes: a model that no worker consumed before (parked on
    # purpose) is no reason to refuse another change.
    models = {n: m for n, m in models.items()
              if n not in now or (now[n].queue, now[n].redis) != (m.queue, m.redis)}
    # A group a live process lacks, or these settings: said by install's check instead.
    models = {n: m for n, m in models.items() if (m.redis or "") in by_group and not any(
        "groups" in r and m.redis and m.redis not in r["groups"]
        for r in (reports or {}).values())}
    return unconsumed(models, {g: {n: r for n, r in reports.items()
                                   if n.startswith("worker:")}
                               for g, reports in by_group.items()})


def _unannounced(target: Path, source: str | Path | None, revision: str, reached: list,
                 exc: redis.RedisError, timeout_s: float, say: Callable[[str], None],
                 settings: Settings, kept: bytes | None = None) -> Result:
    """A Redis stopped answering once the file was installed (a stall, a cut): as after a
    failed load, the file it replaced goes back in place, and back is announced wherever the
    new revision may have been (the failing Redis too, when it answers again at once), so
    that a process restarted on the file on disk serves what the others serve. Else a worker
    restarted by its keeper would read a file no running process took, and refuse it."""
    back, where = revision, reached[-1][0] if reached else ""
    if source is not None:
        previous = target.with_name(target.name + ".previous")
        try:
            back = install(target, previous, settings.redis_group_urls)
        except Invalid as undo:
            say(f"reload refused: Redis{f' group {where}' if where else ''} did not answer "
                f"({exc}), and the previous models file could not be put back ({undo}): fix "
                f"{target} and reload it")
            return Result(REFUSED, revision, lines=[str(exc), str(undo)])
        _set_aside(target, previous, kept, say)
    quiet: Callable[[str], None] = lambda line: None  # noqa: E731
    for name, client, group in reached:
        try:
            if back != revision and client.get(MODELS_REVISION_KEY) == revision:
                _announce(client, target, back, timeout_s, quiet, group, name)
        except redis.RedisError:
            pass  # it never saw the new revision announced, or cannot have served it
    say(f"reload refused, nothing changed: Redis{f' group {where}' if where else ''} did not "
        f"answer ({exc}); {target} is revision {back} as before")
    return Result(REFUSED, revision, lines=[str(exc)])


def _announce(client: redis.Redis, target: Path, revision: str, timeout_s: float,
              say: Callable[[str], None], settings: Settings, group_name: str = "") -> Result:
    """Announce `revision` on `client`'s Redis (Redis group `group_name`'s, "" for the
    default), and wait for every process that watches it to serve it; a group the models
    name must have a worker too."""
    if group_name:
        say(f"Redis group {group_name}:")
    beat, ttl = settings.heartbeat_interval_s, settings.heartbeat_ttl_s
    before, apis_before = standing_of(client, revision, beat, ttl)
    workers_before = {n for n in before if n.startswith("worker:")}
    with client.pipeline() as pipe:  # one step: a worker reads both at once
        pipe.get(REMOVED_FAILED_KEY)  # the jobs ended model_removed so far: it says how many since
        pipe.delete(reload_failed_key(revision))  # a retry, once its host is fixed
        pipe.incr(MODELS_ANNOUNCEMENTS_KEY)  # a worker that refused it begins it again
        pipe.set(MODELS_REVISION_KEY, revision)
        removed, _, announcement, _ = pipe.execute()
    say(f"models file {target} revision {revision} announced")
    try:
        named = group_name and any(m.redis == group_name for m in
                                   parse_models(target, target.read_bytes()).values())
    except (OSError, ConfigError):
        named = False
    return wait(client, revision, timeout_s, say, settings, target, workers_before,
                apis_before, str(announcement), int(removed or 0),
                needs_worker=group_name if named else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make reload", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", help="a models file to check and install in place "
                        "of the one the processes read (default: reload that one as it is)")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds to wait with no process moving on to the new file "
                        "(default 600)")
    args = parser.parse_args(argv)
    # Still among its imports (seconds on a loaded host): a Ctrl-C here is said as one there.
    from scripts.run import own_redis_env
    signal.signal(signal.SIGINT, signal.default_int_handler)

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
    except KeyboardInterrupt:
        print("make reload: interrupted; what was announced goes on in the running processes "
              "(`make reload` again waits on it, or FILE=<the models file>.previous undoes it)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
