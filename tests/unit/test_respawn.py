"""make run's keeper (scripts/respawn.py) starts a process again when it exits on its own, and
tells each new start how the run before ended (IQ_RESPAWN_LAST_EXIT): a Redis primary that
shut down cleanly comes back without a handover (scripts/redis-server.sh). A part whose
configuration fails make run's check is held, not started again for ever."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from scripts.processes import ROOT, wait_until
from scripts.respawn import RECHECK_S


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


def test_a_part_whose_configuration_fails_its_check_is_held_not_restarted_for_ever(tmp_path):
    """The API (`web`) exits, its models file now naming a Redis group its settings lack
    (every start would stop on it again: 30 exits in 75 s, for ever): its keeper says why,
    once, starts it no more while the file fails make run's check, and starts it again once
    the file is fixed."""
    seen, models = tmp_path / "starts", tmp_path / "models.yaml"
    models.write_text("models: {alpha: {kind: synthetic, redis: gpu}}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("IQ_")}
    env.update(IQ_MODELS_FILE=str(models), PYTHONUNBUFFERED="1")
    command = f'echo start >> {seen}; n=$(wc -l < {seen}); [ "$n" = 1 ] && exit 3; ' \
              'exec sleep 60'
    keeper = subprocess.Popen([sys.executable, "-m", "scripts.respawn", "web", command],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(keeper.stdout), daemon=True).start()
    try:
        wait_until(lambda: any("not started again" in line for line in lines), 30,
                   "the keeper to hold it")
        time.sleep(2 * RECHECK_S)  # held: what must not happen is a second start
        assert seen.read_text().split() == ["start"]
        assert lines[0].rstrip() == (
            "web exited with code 3; it is not started again while its configuration fails "
            "make run's check: models.alpha: redis must name a group of redis_groups (none is "
            "configured), got 'gpu' (fix it: web starts once it passes; Ctrl-C stops them "
            "all)"), lines
        models.write_text("models: {alpha: {kind: synthetic}}\n")
        wait_until(lambda: len(seen.read_text().split()) == 2, 30, "the second start")
        assert "web: its configuration passes the check again; starting it\n" in lines
    finally:
        keeper.send_signal(signal.SIGTERM)
        subprocess.run(["pkill", "-TERM", "-s", str(keeper.pid)], check=False)
        keeper.wait(10)
