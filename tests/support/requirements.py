"""What a requirements file installs, read from the installed distributions' metadata: the
pinned distributions with everything they depend on, and the top-level modules those provide.
Lets a test run a process as if only that file had been installed (`guard_env`)."""
from __future__ import annotations

import json
import sysconfig
from importlib import metadata
from pathlib import Path

from scripts.constraints import REQUIREMENTS, ROOT, canonical, closure, pinned  # noqa: F401

GUARD = Path(__file__).resolve().parent / "import_guard"
PROJECT = ("app", "web", "tasks", "config")  # what the API's tree holds of this project


def top_level_modules(distributions: set[str]) -> set[str]:
    """The top-level names the distributions install."""
    return {module for module, dists in metadata.packages_distributions().items()
            if any(canonical(d) in distributions for d in dists)}


def guard_env(env: dict[str, str], path: Path, workdir: Path) -> dict[str, str]:
    """`env` for a process that may import only what `path` installs and the project's
    packages an API host holds: any other top-level module from site-packages or this
    project is refused as if it were not there (tests/support/import_guard)."""
    config = workdir / "import-guard.json"
    config.write_text(json.dumps({
        "allowed": sorted(top_level_modules(closure(path)) | set(PROJECT)),
        "guarded": sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                           str(ROOT)})}))
    return dict(env, PYTHONPATH=str(GUARD), IMPORT_GUARD=str(config))
