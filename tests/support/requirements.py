"""What a requirements file installs, read from the installed distributions' metadata: the
pinned distributions with everything they depend on, and the top-level modules those provide.
Lets a test run a process as if only that file had been installed (`guard_env`)."""
from __future__ import annotations

import json
import re
import sysconfig
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from scripts.stack import ROOT

REQUIREMENTS = ROOT / "requirements"
GUARD = Path(__file__).resolve().parent / "import_guard"
PROJECT = ("app", "tasks", "config")  # what the API's tree holds of this project


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(path: Path) -> list[Requirement]:
    """The requirements a file lists, following its `-r` includes."""
    found = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            found += pinned(path.parent / line[3:].strip())
        elif line:
            found.append(Requirement(line))
    return found


def closure(path: Path) -> set[str]:
    """Every distribution that installing `path` brings, as pip resolves it for this Python:
    each pinned one and, recursively, what it requires (markers and extras evaluated)."""
    seen: set[str] = set()
    todo = [(r, frozenset(r.extras)) for r in pinned(path)]
    while todo:
        requirement, extras = todo.pop()
        name = canonical(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        for spec in metadata.requires(requirement.name) or []:
            needed = Requirement(spec)
            if needed.marker is None or any(needed.marker.evaluate({"extra": e})
                                            for e in extras | {""}):
                todo.append((needed, frozenset(needed.extras)))
    return seen


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
