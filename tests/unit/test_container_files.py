"""The Containerfile and compose.yaml, read without building (building them takes minutes:
`make container-check` does, and tests/integration/test_container.py runs it when asked). What
can be checked from the files alone is checked here, so that a renamed script, a moved folder,
a misspelled variable or a secret handed to the wrong process fails the suite."""
from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import Path

import pytest
import yaml

from config.settings import KNOWN_VARIABLES
from scripts.run import NEEDS, SECRET_VARIABLES

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
# compose's service names against the Procfile's (scripts/run.py NEEDS is by Procfile name).
PROCFILE_NAME = {"api": "web", "worker": "worker", "webhooks": "webhooks", "flower": "flower",
                 "redis": "redis"}
# The variables compose passes only where a secret stands in them (`${...PASSWORD}` etc.).
SECRET_HOLDERS = {"REDIS_URL", "IQ_WEBHOOK_SECRET", "FLOWER_BASIC_AUTH"}


def stages() -> dict[str, list[str]]:
    """Each stage of the Containerfile: the repository paths its COPY lines take (not those
    copied from another stage)."""
    found: dict[str, list[str]] = {}
    current = ""
    for line in (ROOT / "Containerfile").read_text().splitlines():
        if m := re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I):
            current = m.group(1)
            found[current] = []
        elif line.startswith("COPY") and "--from=" not in line:
            found[current] += shlex.split(line)[1:-1]
    return found


def test_every_path_the_containerfile_copies_exists():
    missing = [(stage, path) for stage, paths in stages().items() for path in paths
               if not (ROOT / path).exists()]
    assert missing == [], f"COPY of paths that are not in the repository: {missing}"


def _ignored(path: str) -> bool:
    """Whether .containerignore keeps `path` (or a folder above it) out of the build context."""
    patterns = [line.strip() for line in (ROOT / ".containerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatch(prefix, pattern) or fnmatch.fnmatch(prefix, pattern.lstrip("*/"))
               for prefix in prefixes for pattern in patterns)


@pytest.mark.parametrize("stage", ["api", "worker"])
def test_the_lua_scripts_ship_in_both_images(stage):
    """Every process registers its Lua scripts at start from tasks/lua/*.lua (tasks/lua.py):
    each file is in the build context and copied into both images."""
    scripts = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tasks" / "lua").glob("*.lua"))
    assert scripts
    assert [path for path in scripts if _ignored(path)] == []
    copied = stages()[stage]
    assert [path for path in scripts
            if not any(path.startswith(c.rstrip("/") + "/") for c in copied)] == []


@pytest.mark.parametrize("service", sorted(s for s in SERVICES if "command" in SERVICES[s]))
def test_each_service_starts_a_launcher_its_image_holds(service):
    spec = SERVICES[service]
    image = spec["image"]
    target = "api" if "inference-queue-api" in image else "worker"
    launcher = spec["command"][0]
    assert (ROOT / launcher).is_file(), f"{service}: {launcher} is not in the repository"
    copied = stages()[target]
    assert any(launcher.startswith(path.rstrip("/") + "/") or launcher == path
               for path in copied), f"{service}: the {target} image does not copy {launcher}"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_each_service_gets_only_known_variables_and_its_own_secrets(service):
    environment = SERVICES[service].get("environment", {})
    unknown = [name for name in environment
               if name.startswith("IQ_") and name not in KNOWN_VARIABLES]
    assert unknown == [], f"{service}: variables no process knows (a typo stops it): {unknown}"
    needs = NEEDS[PROCFILE_NAME[service]]
    given = {name for name in environment if name in SECRET_VARIABLES or name in SECRET_HOLDERS}
    assert given <= needs, f"{service} gets secrets it does not use: {sorted(given - needs)}"


def test_the_worker_lua_scripts_ship_in_the_worker_image():
    """The worker's fetch and recovery scripts, workers/broker/lua/*.lua, read at its start."""
    scripts = sorted(str(p.relative_to(ROOT))
                     for p in (ROOT / "workers" / "broker" / "lua").glob("*.lua"))
    assert scripts
    assert [path for path in scripts if _ignored(path)] == []
    copied = stages()["worker"]
    assert [path for path in scripts
            if not any(path.startswith(c.rstrip("/") + "/") for c in copied)] == []


def test_the_api_image_holds_every_package_gunicorn_conf_imports():
    """gunicorn reads gunicorn.conf.py at the API's start; each of the project's packages it
    imports (config/, web/: the worker class it names) is copied into the API image."""
    import ast

    tree = ast.parse((ROOT / "gunicorn.conf.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    ours = sorted(name for name in imported if (ROOT / name / "__init__.py").is_file())
    assert "web" in ours and "config" in ours
    copied = [path.rstrip("/") for path in stages()["api"]]
    assert [name for name in ours if name not in copied] == []
