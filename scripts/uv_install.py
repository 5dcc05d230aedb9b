"""`uv pip install` into this environment, from where pip's configuration says packages come
from (`make test-setup`).

uv installs the tests' environment in ~10 s where pip took ~90 s of one core, fetching and
unpacking one package after another. But uv reads no pip configuration, and a machine's may be
what makes the install right: its own CPU build of torch in a find-links folder (without it,
uv would fetch the multi-GB CUDA build from PyPI), a private index, a certificate authority.
So pip's settings, as `pip config list` gives them (its files' global and install sections,
then its PIP_* variables, each over the one before, as pip takes them), are handed on:
index-url, extra-index-url, find-links, no-index and cert. Every index is searched for the best
version, as pip does (uv's default takes a package from the first index that has it).

    .venv/bin/python -m scripts.uv_install -c requirements/constraints.txt -r requirements/dev.txt
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping

# pip's setting → uv's option; a value may hold several, split at whitespace as pip does.
PASSED_ON = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
             "find-links": "--find-links"}
# Lowest precedence first: pip's configuration files' sections, then its environment.
SECTIONS = ("global", "install", ":env:")
TRUE = {"1", "true", "yes", "on"}


def pip_settings(listing: str) -> dict[str, str]:
    """`pip config list`'s lines (`section.key='value'`), the highest precedence of each key."""
    found: dict[str, dict[str, str]] = {}
    for line in listing.splitlines():
        name, sep, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if sep and section in SECTIONS:
            found.setdefault(key, {})[section] = ast.literal_eval(value)
    return {key: next(by[s] for s in reversed(SECTIONS) if s in by) for key, by in found.items()}


def uv_options(settings: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The options and environment variables that tell uv what `settings` tell pip."""
    options = ["--native-tls", "--index-strategy", "unsafe-best-match"]
    for key, option in PASSED_ON.items():
        options += [part for value in settings.get(key, "").split() for part in (option, value)]
    if settings.get("no-index", "").lower() in TRUE:
        options.append("--no-index")
    env = {"SSL_CERT_FILE": settings["cert"]} if settings.get("cert") else {}
    return options, env


def main(argv: list[str] | None = None) -> int:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], check=True,
                             capture_output=True, text=True).stdout
    options, env = uv_options(pip_settings(listing))
    uv = Path(sys.executable).with_name("uv")
    command = [str(uv), "pip", "install", "-q", "--python", sys.executable, *options,
               *(sys.argv[1:] if argv is None else argv)]
    return subprocess.run(command, env={**os.environ, **env}).returncode


if __name__ == "__main__":
    raise SystemExit(main())
