"""A system tool a test drives (scripts/test_tools.py installs them before the tests): its path,
or a loud failure where `make test` could have installed it, or a skip where it could not."""
from __future__ import annotations

import shutil

import pytest

from scripts.test_tools import TOOLS, can_install


def require(tool: str) -> str:
    assert tool in TOOLS, f"{tool}: add it to scripts/test_tools.py TOOLS, so make test installs it"
    path = shutil.which(tool)
    if path:
        return path
    if can_install():
        pytest.fail(f"{tool} is missing although make test installs it as root "
                    f"(python -m scripts.test_tools): see what apt-get said", pytrace=False)
    pytest.skip(f"{tool} is missing and make test cannot install it here (needs root and apt-get)")
