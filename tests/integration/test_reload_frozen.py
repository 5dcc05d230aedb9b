"""`make reload` while its Redis does not answer (SIGSTOPped: a freeze): it says so within
seconds, one line, exit 2, nothing changed (it once stayed silent for 21.5 s, past
`--timeout 10`); a Ctrl-C prints one line, not a traceback."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from scripts.stack import ROOT, start_redis, wait_until


@pytest.fixture
def frozen(tmp_path):
    server = start_redis(tmp_path)
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": {"quick": {"kind": "synthetic"}}}))
    os.chmod(models, 0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("IQ_")}
    env.update(REDIS_URL=server.extra["url"], IQ_MODELS_FILE=str(models),
               IQ_VAR_DIR=str(tmp_path / "var"), PYTHONUNBUFFERED="1")
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield env
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


@pytest.mark.serial  # its bound is on wall time, with Python's start: no neighbour's CPU in it
def test_a_frozen_redis_is_said_within_seconds(frozen):
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "scripts.reload", "--timeout", "10"], cwd=ROOT,
                          env=frozen, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.startswith("reload refused, nothing changed: Redis did not answer"), \
        done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert took < 10, took  # a 5 s bound on the call, and the start of Python


def _loading_redis(pid: int) -> bool:
    """redis-py's C parser mapped: the process is among its imports, before main() runs."""
    return "hiredis" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("moment", ["among-its-imports", "after-2s"])
def test_ctrl_c_prints_one_line(frozen, moment):
    proc = subprocess.Popen([sys.executable, "-m", "scripts.reload"], cwd=ROOT, env=frozen,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if moment == "among-its-imports":
        wait_until(lambda: _loading_redis(proc.pid), 30, "scripts.reload importing redis",
                   interval=0.001)
    else:
        time.sleep(2)  # not a synchronisation: a Ctrl-C at whatever point it has reached
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("make reload: interrupted"), err
