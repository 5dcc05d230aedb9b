"""The system tools the tests drive are installed once, before the tests (scripts/test_tools.py,
`make test`'s first step), and a test whose tool is still missing fails where make test could
have installed it: a skip there hid the multi-host tests on a fresh machine (issue 42)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from scripts import test_tools
from tests.support import tools

ROOT = Path(__file__).resolve().parents[2]


def _without(monkeypatch, tool: str) -> None:
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == tool
                        else which(name, *a, **k))


def test_a_missing_tool_fails_the_test_where_make_test_installs_it(monkeypatch):
    _without(monkeypatch, "iptables")
    monkeypatch.setattr(tools, "can_install", lambda: True)
    with pytest.raises(pytest.fail.Exception, match="iptables is missing although make test"):
        tools.require("iptables")


def test_a_missing_tool_skips_only_where_make_test_cannot_install_it(monkeypatch):
    _without(monkeypatch, "faketime")
    monkeypatch.setattr(tools, "can_install", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="needs root and apt-get"):
        tools.require("faketime")


def test_a_tool_no_one_installs_is_refused():
    with pytest.raises(AssertionError, match="add it to scripts/test_tools.py"):
        tools.require("nmap")


def test_make_test_installs_the_tools_before_pytest_starts():
    """The dry run of `make test` runs scripts.test_tools before pytest, once."""
    plan = subprocess.run(["make", "-n", "-B", "test"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout
    steps = [i for i, line in enumerate(plan.splitlines())
             if re.search(r"-m (scripts\.test_tools|pytest)\b", line)]
    assert [re.search(r"-m (\S+)", plan.splitlines()[i])[1] for i in steps] == \
        ["scripts.test_tools", "pytest"]


def test_every_tool_a_test_requires_is_one_make_test_installs():
    asked = {m for path in (ROOT / "tests").rglob("*.py") if path != Path(__file__)
             for m in re.findall(r'require\("([^"]+)"\)', path.read_text())}
    assert asked == {"chromium", "iptables", "faketime"}, asked
    assert asked <= set(test_tools.TOOLS), asked - set(test_tools.TOOLS)
