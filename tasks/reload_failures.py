"""A reload's models file that a new pool child could not load (workers/main.py), or whose
canary an API process could not start (app/reloading.py): the child (or API process)
records it in Redis (tasks/keys.py `reload_failed_key`) and exits, rather than stop its
worker; its worker's main process, and every other worker on that revision, roll back to the
revision they served (workers/batching/reload.py), and `make reload` reports it
(scripts/reload_wait.py). One such failure halts the rolling update: no other worker tries the
file. Both sides read it here: it is part of the contract between the workers and the reload
command."""
from __future__ import annotations

import time
import traceback

import orjson
import redis

from config import Settings
from config.values import shortened
from tasks.keys import reload_failed_key
from tasks.redis_client import connect

# Long enough for any reload to see it; `make reload` clears it when it announces the
# revision again (an operator who fixed the host retries the same file).
FAILED_TTL_S = 24 * 3600
_MAX_ERROR = 300  # characters of a recorded error
_MOST_NOTE = 100  # characters of each note (what was being done) in it


def one_line(exc: BaseException, whole: bool = False, most: int = _MAX_ERROR) -> str:
    """The exception as one short line: what was being done, as its notes say (the model a
    pool child was loading: workers/child/runtime.py), then its type and the first line of
    its message (`whole`: all of it, its lines joined: a TorchScript error's first line names
    no cause); an exception group's, each error it holds. A message that cannot be made (its
    `__str__` raises) is said so; control characters are escaped."""
    if isinstance(exc, BaseExceptionGroup):
        # Its own line only: traceback's description of a group describes every error in it,
        # nested as deep as they go (a RecursionError some hundreds deep), most of it cut.
        text = _own_line(exc)
    else:
        described = traceback.TracebackException.from_exception(exc, limit=0)
        described.__notes__ = None  # said below, as this line says them
        lines = list(described.format_exception_only())
        text = " ".join(" ".join(lines).split()) if whole else lines[-1].strip()
    text = text.splitlines()[0] if text else type(exc).__name__
    # Each note cut short: a 290-character model name left no room for the error itself.
    text = ": ".join([*(shortened(" ".join(n.split()), _MOST_NOTE) for n in _notes(exc)), text])
    if isinstance(exc, BaseExceptionGroup):  # its own line says only how many it holds
        text += " [" + "; ".join(_held(exc, whole, most - len(text) - len(" []"))) + "]"
    # Escaped, not sent on: a terminal's control codes in a model's name or an error's message
    # reach make reload's answer and the worker's log (the re-attack of session 14).
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return shortened(text, most)


def _held(group: BaseExceptionGroup, whole: bool, room: int) -> list[str]:
    """The group's errors, each in one line (a nested group's with its own), as many as
    `room` characters hold with "; " between them, and "…" for those left out."""
    said: list[str] = []
    used = 0
    for inner in group.exceptions:
        left = room - used - len("; …")  # kept for those left out
        if left < 2:
            said.append("…")
            break
        said.append(one_line(inner, whole, left))
        used += len(said[-1]) + len("; ")
    return said


def _notes(exc: BaseException) -> list[str]:
    """Its notes as text: `add_note` keeps strings, but `__notes__` is anyone's to set."""
    notes = getattr(exc, "__notes__", None)
    if notes is None:
        return []
    if isinstance(notes, str) or not isinstance(notes, (list, tuple)):
        notes = [notes]
    said = []
    for note in notes:
        try:
            said.append(str(note))
        except Exception:  # noqa: BLE001 - said as traceback says an error it cannot say
            said.append("<note str() failed>")
    return said


def _own_line(group: BaseExceptionGroup) -> str:
    """What traceback's last line says of a group: its type (with its module, but for the
    builtins') and its message, which counts the errors it holds."""
    kind = type(group)
    name = kind.__qualname__
    if kind.__module__ not in ("builtins", "__main__"):
        name = f"{kind.__module__}.{name}"
    try:
        said = str(group)
    except Exception:  # noqa: BLE001 - as traceback says it
        said = "<exception str() failed>"
    return f"{name}: {said}" if said else name


def record(settings: Settings, revision: str, worker: str, exc: BaseException) -> bool:
    """In the pool child whose load failed: whether the failure is recorded (else its worker
    must stop, as at its first start: nothing else would stop the respawns)."""
    failure = {"worker": worker, "error": one_line(exc), "at": time.time()}
    try:
        client = connect(settings.redis_url, settings, deadline_s=5.0)
        client.set(reload_failed_key(revision), orjson.dumps(failure), ex=FAILED_TTL_S)
    except redis.RedisError:
        return False
    return True


def record_refusal(client: redis.Redis, revision: str, process: str, error: str) -> None:
    """In an API process whose canary of `revision` failed (app/reloading.py): as a pool
    child's failed load, it halts the roll, the workers that began it rolling back.
    `process`: its report's field (`api:<host>/<pid>`)."""
    error = shortened(error, _MAX_ERROR)
    failure = {"worker": process, "error": error, "at": time.time()}
    client.set(reload_failed_key(revision), orjson.dumps(failure), ex=FAILED_TTL_S)


def failed_where(failure: dict) -> str:
    """The process a failure names, as `make reload` lists it: `worker:<node>` for a pool
    child's, `api:<host>/<pid>` for an API process's canary."""
    where = str(failure.get("worker"))
    return where if where.startswith("api:") else f"worker:{where}"


def failure_of(client: redis.Redis, revision: str) -> dict | None:
    """The recorded failure of `revision`, or None (also when Redis does not answer)."""
    try:
        raw = client.get(reload_failed_key(revision))
    except redis.RedisError:
        return None
    return orjson.loads(raw) if raw else None


def describe(revision: str, failure: dict) -> str:
    return (f"models file revision {revision} could not be loaded on "
            f"{failed_where(failure).replace(':', ' ', 1)}: {failure.get('error')}")
