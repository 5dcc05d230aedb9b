"""An earlier commit of this service as a benchmark configuration, so that a change is measured
side by side with the code it replaces (`python -m bench --baseline 9ccd8b9`).

The commit's tree is exported (`git archive`) under var/bench-baseline/<commit>, once, and its
stack is started by its own launcher (its scripts/stack.py, or tests/support/services.py before
c2b6f63), whose paths point into that tree: its own Redis, API (as that commit ran it) and
worker, on this checkout's virtualenv (linked as its .venv). Nothing of the old code is
committed; var/ is ignored.
"""
from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import tarfile
import threading
from io import BytesIO
from pathlib import Path
from types import ModuleType
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
EXPORTS = ROOT / "var" / "bench-baseline"


def resolve(rev: str) -> str:
    """The full commit id of `rev` (a short id, a tag, a branch); exits with a message naming
    `rev` when it is not a commit here."""
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                           cwd=ROOT, capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"--baseline {rev}: not a commit of this repository")
    return found.stdout.strip()


def checkout(rev: str) -> Path:
    """The tree of `rev`, exported once under var/bench-baseline/<commit id>."""
    commit = resolve(rev)
    tree = EXPORTS / commit
    done = tree / ".exported"
    if not done.exists():
        archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT,
                                 capture_output=True, check=True).stdout
        tree.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(tree, filter="data")
        done.write_text(commit + "\n")
    venv = tree / ".venv"
    if not venv.exists() and (ROOT / ".venv").exists():
        # Its scripts name .venv/bin/python (scripts/redis-server.sh since issue 26): this
        # checkout's virtualenv, as the rest of its stack runs on.
        venv.symlink_to(ROOT / ".venv")
    return tree


# The packages a launcher imports from its own tree.
_PACKAGES = ("scripts", "tests")

# Where the stack launcher lived: scripts/stack.py since c2b6f63, tests/support before.
LAUNCHERS = ("scripts/stack.py", "tests/support/services.py")
# Held while a launcher loads: the benchmark starts its stacks from threads, and a second
# thread must not take a module from sys.modules before it has run.
_loading = threading.Lock()


def launcher(tree: Path) -> ModuleType:
    """The commit's own service launcher (scripts/stack.py, or tests/support/services.py in
    older commits), loaded from its tree: it starts processes in that tree, as that commit
    started them."""
    name = f"_bench_baseline_services_{tree.name[:12]}"
    with _loading:
        if name in sys.modules:
            return sys.modules[name]
        path = next((tree / p for p in LAUNCHERS if (tree / p).exists()), tree / LAUNCHERS[-1])
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec and spec.loader, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up there
        try:
            with _own_packages(tree):
                spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module


@contextlib.contextmanager
def _own_packages(tree: Path) -> Iterator[None]:
    """While a launcher loads, `scripts` and `tests` are its tree's: a launcher split in
    modules (scripts/stack.py importing scripts/processes.py, whose ROOT is where processes
    start) must not start this checkout's code. The loaded modules keep their references."""
    def ours(name: str) -> bool:
        return name.split(".", 1)[0] in _PACKAGES

    saved = {k: m for k, m in sys.modules.items() if ours(k)}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(tree))
    try:
        yield
    finally:
        sys.path.remove(str(tree))
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)
