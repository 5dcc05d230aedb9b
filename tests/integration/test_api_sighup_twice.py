"""A graceful reload of the API's gunicorn (SIGHUP: a `make reload`, an operator's) while an API
process boots (its predecessor killed, or two reloads back to back), one API process, default
settings: the reload tells the booting process to stop before it has set its own signal
handlers, the master's still in place. It must not take the master's stop for its own: before, it wrote the master's `stop`
note (web/handover.py `stop_noted`), after which every process gunicorn started saw a stop
and exited as it booted, one after another, nothing serving, until gunicorn was restarted."""
from __future__ import annotations

import glob
import os
import signal
import time

import requests

from scripts.stack import wait_until
from tests.integration.test_api_sighup import processes, start_api


def first_child(master: int, old: set[int]) -> int:
    """The first process gunicorn forks after `old`, as soon as it is there."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        new = processes(master) - old
        if new:
            return min(new)
    raise TimeoutError("no API process forked")


def test_a_process_told_to_stop_while_it_boots_does_not_stop_gunicorn(tmp_path):
    server, web = start_api(tmp_path, 1, TMPDIR=str(tmp_path))
    try:
        master = web.proc.pid
        wait_until(lambda: len(processes(master)) == 1, 60, "one API process")
        old = processes(master)
        for pid in old:  # killed (out of memory): gunicorn starts another
            os.kill(pid, signal.SIGKILL)
        booting = first_child(master, old)
        os.kill(booting, signal.SIGSTOP)  # held as it boots, with the master's handlers still
        os.kill(master, signal.SIGHUP)  # a reload: its SIGTERM waits for it
        wait_until(lambda: processes(master) - old - {booting}, 30, "the reload's process forked")
        os.kill(booting, signal.SIGCONT)
        wait_until(lambda: booting not in processes(master), 120, "the one told to stop gone")
        folder, = glob.glob(str(tmp_path / "iq-api-handover-*"))
        assert "stop" not in os.listdir(folder), "a reload's SIGTERM noted as gunicorn's stop"
        serving = processes(master)
        answered = requests.post(f"{web.extra['url']}/v1/jobs", timeout=30,
                                 json={"model": "quick", "inputs": ["x"]})
        assert answered.status_code == 202, answered.text
        assert processes(master) == serving, "the process serving went on serving"
        assert "before this process was ready" not in web.log.read_text(errors="replace")
    finally:
        web.stop()
        server.stop()
