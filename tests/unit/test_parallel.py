"""The suite's arrangement over xdist's processes (tests/support/parallel.py): tests sharing a
module's stack run in one process, which starts it once, and a `serial` test runs alone."""
from __future__ import annotations

import re
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from scripts.stack import ROOT
from tests.support.parallel import turn

SHARED_MODULE = '''
import pytest

@pytest.fixture(scope="module")
def private(tmp_path_factory):
    with open(tmp_path_factory.getbasetemp().parent.parent / "setups", "a") as log:
        log.write("setup\\n")

@pytest.mark.parametrize("n", range(4))
def test_shares_the_module_fixture(private, n):
    pass
'''


def test_a_modules_tests_share_one_process_and_one_setup(tmp_path):
    """Four tests of a module with a module-scoped fixture, two processes: xdist puts them in
    one group (a suffix to each node id, which pytest 9.2 ignores: pytest-xdist#1386), so the
    fixture is set up once, not once in each process."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        "from tests.support.parallel import pytest_collection_modifyitems  # noqa: F401\n")
    (suite / "test_shared.py").write_text(SHARED_MODULE)
    (suite / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "base").mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
         "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "base" / "run"), str(suite)],
        cwd=suite, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    passed = re.findall(r"PASSED test_shared\.py::test_shares_the_module_fixture\[\d\](\S*)",
                        out.stdout)
    assert passed == ["@test_shared.py"] * 4, out.stdout[-3000:]  # each in the module's group
    assert (tmp_path / "base" / "setups").read_text() == "setup\n"


def item(basetemp, serial: bool = False):
    marks = {"serial": object()} if serial else {}
    return SimpleNamespace(get_closest_marker=marks.get, config=SimpleNamespace(
        _tmp_path_factory=SimpleNamespace(getbasetemp=lambda: basetemp)))


def test_a_serial_test_waits_for_the_running_ones_which_share_the_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    basetemp = tmp_path / "gw0"
    entered = threading.Event()

    def serial() -> None:
        with turn(item(basetemp, serial=True)):
            entered.set()

    with turn(item(basetemp)):
        with turn(item(basetemp)):
            pass  # two tests run side by side
        waiting = threading.Thread(target=serial)
        waiting.start()
        assert not entered.wait(1), "a serial test started beside a running one"
    assert entered.wait(10), "the serial test never started"
    waiting.join(10)
