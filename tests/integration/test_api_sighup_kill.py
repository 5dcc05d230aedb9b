"""A new API process SIGKILLed during a graceful reload's hand-over (gunicorn.conf.py), one API
process, default settings, under a steady stream of submits: gunicorn starts its replacement at
once, the old process accepts until that one is up, and no submit is refused or waits past its
deadline. (Before, gunicorn starts another only once fewer processes run than it should, which
the old process, accepting until a new one is up, never let happen: it held on for the master's
`timeout`, 60 s, then left, and nothing accepted while the replacement booted.)"""
from __future__ import annotations

import os
import signal
import time

from config import Settings
from scripts.stack import wait_until
from tests.integration.test_api_sighup import Submits, processes, start_api


def test_a_new_process_killed_in_the_hand_over_is_replaced_at_once(tmp_path):
    server, web = start_api(tmp_path, 1)
    submits = None
    try:
        master = web.proc.pid
        wait_until(lambda: len(processes(master)) == 1, 60, "one API process")
        old = processes(master)
        submits = Submits(web.extra["url"]).start()
        wait_until(lambda: len(submits.sent) >= 20, 60, "submits answered before the reload")
        hup = time.monotonic()
        os.kill(master, signal.SIGHUP)
        wait_until(lambda: processes(master) - old, 30, "the new process forked")
        killed = processes(master) - old
        for pid in killed:  # held first, so that it is killed before it is up
            os.kill(pid, signal.SIGSTOP)
        assert processes(master) >= old, "the old process still there, handing over"
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        # Well within the master's 60 s timeout, after which the old process left anyway.
        wait_until(lambda: processes(master) - old - killed, 20,
                   "a replacement for the killed process started while the old one hands over")
        wait_until(lambda: not processes(master) & old and len(processes(master)) == 1, 120,
                   "the old API process replaced")
        replaced = time.monotonic()
        wait_until(lambda: sum(1 for t, _, _ in submits.sent if t > replaced) >= 20, 60,
                   "submits answered by the new process")
        submits.stop()
    finally:
        if submits is not None:
            submits.stop()
        web.stop()
        server.stop()
    across = [(round(t - hup, 2), round(took, 3), status) for t, took, status in submits.sent
              if hup <= t <= replaced]
    assert len(across) >= 4, "submits were sent while the processes were replaced"
    assert {status for _, _, status in submits.sent} == {202}, \
        [s for s in across if s[2] != 202]
    late = [s for s in across if s[1] >= Settings.redis_deadline_s]
    assert not late, f"submits (sent s after the SIGHUP, waited s) past the deadline: {late}"
