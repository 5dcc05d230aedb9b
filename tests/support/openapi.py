"""schemathesis run from a test against a live stack: its command line (the CLI is its stable
interface), the project's configuration (tests/support/schemathesis.toml) and every check."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from scripts.stack import ROOT

CONFIG = ROOT / "tests" / "support" / "schemathesis.toml"


def schemathesis(api: str, *extra: str, max_examples: int = 20) -> subprocess.CompletedProcess:
    """`schemathesis run --checks all` over every phase, stateful included, in one thread:
    in two, Python 3.11's `ast` (which hypothesis uses to describe a strategy) raised "AST
    constructor recursion depth mismatch" (CPython gh-106905)."""
    return subprocess.run(
        [str(Path(sys.executable).parent / "schemathesis"), "--config-file", str(CONFIG),
         "run", f"{api}/openapi.json", "--checks", "all", "--max-examples", str(max_examples),
         "--seed", "1", "--workers", "1", "--no-shrink", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"})
