"""The house rule of issue 23: no module over 350 lines and no function over 60 in the project's
own code (app/, tasks/, workers/, config/, scripts/, bench/ and the client's package), so that
each concern keeps a room of its own. One that grows past it is split along a seam (a module
per concern, a function per named step), not squeezed."""
from __future__ import annotations

import ast

from scripts.stack import ROOT

PACKAGES = ("app", "tasks", "workers", "config", "scripts", "bench",
            "client/inference_queue_client")
MAX_MODULE_LINES = 350
MAX_FUNCTION_LINES = 60


def offenders() -> list[str]:
    """One line per module or function over its size, naming it and its length."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            source, shown = path.read_text(), path.relative_to(ROOT)
            lines = source.count("\n")
            if lines > MAX_MODULE_LINES:
                found.append(f"module {shown}: {lines} lines (at most {MAX_MODULE_LINES})")
            for node in ast.walk(ast.parse(source, str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found.append(f"function {shown}:{node.lineno} {node.name}: {length} "
                                     f"lines (at most {MAX_FUNCTION_LINES})")
    return found


def test_the_check_reads_every_package():
    for package in PACKAGES:
        assert any((ROOT / package).rglob("*.py")), package


def test_no_module_or_function_is_over_its_size():
    found = offenders()
    assert not found, "split each along a seam (issue 23):\n  " + "\n  ".join(found)
