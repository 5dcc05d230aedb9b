"""The models file a worker's spawned pool children load: the one its main process serves.

A spawned child builds the Celery app again (workers/main.py), and used to read the models
file from disk to do so. A file edited on disk but not yet announced (`make reload` without
FILE reloads the file as it is: it is edited first), or installed a heartbeat before the main
process saw the announcement, was then what a child restarted after a crash loaded: a model
the main process still routes to it missing (the child's load failed and its worker stopped),
or another version than the worker serves. So the main process hands its children the bytes
of the file it serves, in their environment (which spawned children inherit); a child reads
them only from its own parent."""
from __future__ import annotations

import base64
import os
from pathlib import Path

import orjson

from config.models import ModelSpec, parse_models, revision_of

# Not an IQ_ setting: config refuses IQ_ variables it does not know.
ENV = "INFERENCE_QUEUE_MODELS_PINNED"


def pin(content: bytes) -> None:
    """In the main process: the children started from now on load `content`."""
    os.environ[ENV] = orjson.dumps({"pid": os.getpid(),
                                    "content": base64.b64encode(content).decode()}).decode()


def pinned(models_file: str) -> tuple[dict[str, ModelSpec], str] | None:
    """In a pool child: its main process's models and their revision (None elsewhere)."""
    from billiard.process import current_process

    raw = os.environ.get(ENV)
    # A worker's main process may have inherited one too (started by a process that imported
    # workers.main): only a pool child of the process that pinned it reads it.
    if not raw or current_process().name == "MainProcess":
        return None
    found = orjson.loads(raw)
    if found.get("pid") != os.getppid():
        return None
    content = base64.b64decode(found["content"])
    return parse_models(Path(models_file), content), revision_of(content)
