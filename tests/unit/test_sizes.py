"""A ceiling on sizes in the project's own code (app/, web/, tasks/, workers/, config/, scripts/,
bench/ and the client's package): no module over 800 lines, no function over 60.

Modules are cut by concern, not by size: issue 23's rule of 350 lines a module split concerns
apart to fit it (a job's record from the moves that write it, re-exported to hide the seam;
Lua carried in Python strings across nine modules), which issue 38 merged back. So the module
bound is only a generous ceiling, above the largest module of one concern (tasks/jobstate.py,
a job's record and its moves: about 600 lines) with room for it to grow, that a module reaches
when it takes in a second concern: one that does is cut where its concerns part, never to fit
a number. A function stays within 60 lines, one named step each."""
from __future__ import annotations

import ast

from scripts.stack import ROOT

PACKAGES = ("app", "web", "tasks", "workers", "deliverer", "config", "scripts", "bench",
            "client/inference_queue_client")
MAX_MODULE_LINES = 800
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
    assert not found, "cut each where its concerns part:\n  " + "\n  ".join(found)
