"""make run's keeper (scripts/respawn.py) starts a process again when it exits on its own, and
tells each new start how the run before ended (IQ_RESPAWN_LAST_EXIT): a Redis primary that
shut down cleanly comes back without a handover (scripts/redis-server.sh)."""
from __future__ import annotations

import signal
import subprocess
import sys

from scripts.processes import ROOT, wait_until


def test_each_start_after_the_first_is_told_how_the_run_before_ended(tmp_path):
    seen = tmp_path / "starts"
    # Each start appends what it was told; the first exits 0, the second 3, the third is
    # killed by SIGKILL; the fourth waits to be stopped.
    command = (f'echo "${{IQ_RESPAWN_LAST_EXIT-unset}}" >> {seen}; '
               f'n=$(wc -l < {seen}); '
               'if [ "$n" = 1 ]; then exit 0; fi; if [ "$n" = 2 ]; then exit 3; fi; '
               'if [ "$n" = 3 ]; then kill -9 $$; fi; exec sleep 60')
    keeper = subprocess.Popen([sys.executable, "-m", "scripts.respawn", "probe", command],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        wait_until(lambda: seen.exists() and len(seen.read_text().split()) == 4, 30,
                   "four starts")
    finally:
        keeper.send_signal(signal.SIGTERM)
        subprocess.run(["pkill", "-TERM", "-s", str(keeper.pid)], check=False)
        keeper.wait(10)
    assert seen.read_text().split() == ["unset", "0", "3", str(-signal.SIGKILL)]
