"""What a worker entry module whose prefork pool spawns its children must do first, and the
folder of its own that it hands them."""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)


def project_on_path() -> None:
    """Put the project's root on sys.path for good. Spawned pool children unpickle references
    to this project's code, so its root must be on their sys.path, which they copy from their
    parent's. `celery -A` puts the working directory there only while it imports the app
    module, and takes that entry out again: so the root is appended even when it is there
    already (it may be that entry). Called once, when the entry module is imported."""
    sys.path.append(ROOT)


# The worker's own folder (not an IQ_ setting: the main process names it for its children).
FOLDER_VARIABLE = "_IQ_WORKER_FOLDER"


def make_own_folder() -> Path:
    """In the main process, before its children start: a folder of its own (mkdtemp: 0700),
    named in the environment its spawned children inherit and removed at its exit (left only
    by a kill -9). The children's metrics are there (workers/metrics.py); a child writes
    there why it could not load its models (workers/child/load_failure.py); the stand-in's
    children take turns on their device through a lock there
    (workers/child/handlers/tensor.py)."""
    folder = tempfile.mkdtemp(prefix="iq-worker-")
    os.environ[FOLDER_VARIABLE] = folder
    atexit.register(shutil.rmtree, folder, True)
    return Path(folder)


def own_folder() -> Path | None:
    """The worker's own folder, in its main process (once made) and its children; None
    outside a worker (the batch-size calibrator loads a model alone)."""
    found = os.environ.get(FOLDER_VARIABLE)
    return Path(found) if found else None
