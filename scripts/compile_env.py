"""The bytecode of every installed package, compiled on every core the machine gives: `make`'s
installs (uv's, and pip's with `--no-compile`) compile nothing, then this runs.

pip compiles the files of each package it installs one after another: for requirements/dev.txt,
~75 s of one core, two thirds of pip's whole install (121 s here with pip's compile, 44 s
without). Here the files are dealt out to one process per usable core (on this 2-vCPU
machine, ~50 s for the ~14,000 files, the two sharing one physical core's time; a 16-core host
takes a fraction of that), each compiling its share as pip would (compileall.compile_file: a
timestamp-checked .pyc beside each file, a file that does not compile left as it is, as pip
leaves it); the packages' own test suites are left out. Bytecode is written whatever
PYTHONDONTWRITEBYTECODE says: the processes of `make run` and of the tests then read it, and a
user without write access to the environment (IQ_RUN_USERS=separate) never compiles torch anew.

    python -m scripts.compile_env      # the environment of the Python that runs it
    python -m scripts.compile_env --project   # this checkout's own modules (make test)

The checkout's own modules are compiled the same way before the tests (`make test`): under
PYTHONDONTWRITEBYTECODE every process the tests start (~1,000 of them: APIs, workers, pool
children, scripts) would otherwise compile the modules it imports anew, ~0.13 s of CPU each
for an API's or a worker's; a file changed since is compiled again at its next import, as
Python checks each .pyc's timestamp.
"""
from __future__ import annotations

import argparse
import compileall
import os
import subprocess
import sys
import sysconfig
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _compile(files: list[str]) -> None:
    for path in files:
        compileall.compile_file(path, quiet=2)


def package_files() -> list[str]:
    """The environment's Python files, but for the packages' own test suites (a `tests`
    folder: ~2,300 of ~16,000 files, sympy's, scipy's, numpy's...), which nothing here
    imports."""
    roots = {sysconfig.get_paths()[name] for name in ("purelib", "platlib")}
    return sorted(str(path) for root in roots for path in Path(root).rglob("*.py")
                  if "tests" not in path.relative_to(root).parts[:-1])


def project_files(root: Path = ROOT) -> list[str]:
    """The checkout's own Python files: those git tracks (in a fresh clone, all of them); in
    a copy git cannot read (an export, another user's checkout), every one outside the
    environment, var/ and hidden folders."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", "*.py"], cwd=root, check=True,
                                capture_output=True, text=True).stdout
        files = sorted(str(root / name) for name in listed.split("\0") if name)
        why = "" if files else "none of its files is tracked (a copy inside another checkout?)"
    except (OSError, subprocess.CalledProcessError) as exc:
        said = (getattr(exc, "stderr", None) or str(exc)).strip().splitlines()
        why = next((line for line in said if line.startswith("fatal:")), said[0] if said else "")
    if not why:
        return files
    print(f"compile_env: git lists no files here ({why.strip()}): compiling every .py file of "
          f"{root}", file=sys.stderr)
    return sorted(str(path) for path in root.rglob("*.py")
                  if not any(part.startswith(".") or part == "var"
                             for part in path.relative_to(root).parts[:-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.compile_env")
    parser.add_argument("--project", action="store_true",
                        help="this checkout's own modules instead of the environment's")
    files = project_files() if parser.parse_args(argv).project else package_files()
    cores = max(1, len(os.sched_getaffinity(0)))
    with ProcessPoolExecutor(cores) as pool:
        list(pool.map(_compile, [files[i::cores] for i in range(cores)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
