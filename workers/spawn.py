"""What a worker entry module whose prefork pool spawns its children must do first."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)


def project_on_path() -> None:
    """Put the project's root on sys.path for good. Spawned pool children unpickle references
    to this project's code, so its root must be on their sys.path, which they copy from their
    parent's. `celery -A` puts the working directory there only while it imports the app
    module, and takes that entry out again: so the root is appended even when it is there
    already (it may be that entry). Called once, when the entry module is imported."""
    sys.path.append(ROOT)
