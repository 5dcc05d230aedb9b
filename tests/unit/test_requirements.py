"""requirements/ per process: the API's requirements bring no torch, transformers or matplotlib
(not even as a dependency of a dependency), and provide every module app/, tasks/ and config/
import, at the top or inside a function (tests/integration/test_requirements.py runs the API,
Flower and the celery cli on them alone)."""
from __future__ import annotations

import sys

import grimp

from tests.support.requirements import PROJECT, REQUIREMENTS, closure, top_level_modules

HEAVY = {"torch", "transformers", "sentence-transformers", "matplotlib"}


def test_the_api_requirements_bring_no_torch_transformers_or_matplotlib():
    api = closure(REQUIREMENTS / "api.txt")
    assert "flask" in api and "celery" in api and "pillow" in api  # the closure is read
    assert not api & HEAVY, api & HEAVY
    assert HEAVY - {"sentence-transformers"} <= closure(REQUIREMENTS / "worker.txt")


def test_the_api_requirements_provide_every_module_the_api_imports():
    graph = grimp.build_graph(*PROJECT, include_external_packages=True)
    imported = {m for m in graph.modules if "." not in m and m not in PROJECT}
    provided = top_level_modules(closure(REQUIREMENTS / "api.txt"))
    assert imported - provided - set(sys.stdlib_module_names) == set()

