"""A new API process SIGKILLed during a graceful reload's hand-over (web/handover.py), one API
process, default settings, under a steady stream of submits: gunicorn starts its replacement at
once, the old process accepts until that one is up, and no submit is refused or waits past its
deadline. (Before, gunicorn starts another only once fewer processes run than it should, which
the old process, accepting until a new one is up, never let happen: it held on for the master's
`timeout`, 60 s, then left, and nothing accepted while the replacement booted.)"""
from __future__ import annotations

import os
import signal

from config import Settings
from scripts.stack import wait_until
from tests.integration.test_api_sighup import (await_replaced, hung_up_under_submits, processes,
                                              sent_across)


def test_a_new_process_killed_in_the_hand_over_is_replaced_at_once(tmp_path):
    with hung_up_under_submits(tmp_path, 1) as (master, old, submits, hup):
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
        replaced = await_replaced(master, old, 1, submits)
    across = sent_across(submits, hup, replaced)
    assert len(across) >= 4, "submits were sent while the processes were replaced"
    late = [s for s in across if s[1] >= Settings.redis_deadline_s]
    assert not late, f"submits (sent s after the SIGHUP, waited s) past the deadline: {late}"
