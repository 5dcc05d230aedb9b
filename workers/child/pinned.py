"""The models file a worker's spawned pool children load: the one its main process serves.

A spawned child builds the Celery app again (workers/main.py), and used to read the models
file from disk to do so. A file edited on disk but not yet announced (`make reload` without
FILE reloads the file as it is: it is edited first), or installed a heartbeat before the main
process saw the announcement, was then what a child restarted after a crash loaded: a model
the main process still routes to it missing (the child's load failed and its worker stopped),
or another version than the worker serves. So the main process hands its children the bytes
of the file it serves, in their environment (which spawned children inherit); a child reads
them only from its own parent.

A reload pins the new file as a reload's (`reload_from`, the revision it replaces): a child
that cannot load it records the failure rather than stop its worker (tasks/reload_failures.py),
and the worker rolls back (workers/batching/reload.py)."""
from __future__ import annotations

import base64
import os
from pathlib import Path

import orjson

from config.models import ModelSpec, parse_models, revision_of

# Not an IQ_ setting: config refuses IQ_ variables it does not know.
ENV = "INFERENCE_QUEUE_MODELS_PINNED"


def pin(content: bytes, reload_from: str = "") -> None:
    """In the main process: the children started from now on load `content`; `reload_from`:
    the revision a reload replaces with it ("" when it is what the worker serves)."""
    os.environ[ENV] = orjson.dumps({"pid": os.getpid(), "reload_from": reload_from,
                                    "content": base64.b64encode(content).decode()}).decode()


def pinned_content() -> bytes | None:
    """In the main process: the bytes it pinned last."""
    raw = os.environ.get(ENV)
    found = orjson.loads(raw) if raw else {}
    return base64.b64decode(found["content"]) if found.get("pid") == os.getpid() else None


def _from_parent() -> dict | None:
    from billiard.process import current_process

    raw = os.environ.get(ENV)
    # A worker's main process may have inherited one too (started by a process that imported
    # workers.main): only a pool child of the process that pinned it reads it.
    if not raw or current_process().name == "MainProcess":
        return None
    found = orjson.loads(raw)
    return found if found.get("pid") == os.getppid() else None


def pinned(models_file: str) -> tuple[dict[str, ModelSpec], str] | None:
    """In a pool child: its main process's models and their revision (None elsewhere)."""
    found = _from_parent()
    if found is None:
        return None
    content = base64.b64decode(found["content"])
    return parse_models(Path(models_file), content), revision_of(content)


def reload_from() -> str:
    """In a pool child: the revision the reload it was started for replaces ("" when none)."""
    found = _from_parent()
    return found.get("reload_from", "") if found else ""
