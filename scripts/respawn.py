"""`make run`'s keeper of one Procfile process: it runs the command and, when the process exits
on its own (a crash, a kill, a watchdog's stop), starts it again and says so, instead of honcho
stopping the whole stack because one part ended. A SIGTERM, SIGINT or SIGQUIT (make run's
stop, scripts/run_stop.py) stops it for good: the process itself gets the same signal, in its
process group.
Each start after the first has IQ_RESPAWN_LAST_EXIT, the exit status of the run before (as
/bin/sh reports it: 137 for a SIGKILL; negative when the shell itself was killed), for a
process whose start depends on how it ended (scripts/redis-server.sh: a Redis primary that
shut down cleanly needs no handover).

    python -m scripts.respawn [--user USER] NAME COMMAND

With --user (make run with IQ_RUN_USERS=separate: scripts/run_users.py), the keeper stays
root, to stop and start the part, and starts it as USER, with USER's groups; its check below
runs as USER too (`checked_as`).

A part that reads the settings and the models file (`CHECKED`) and exits while they fail the
check `make run` makes before it starts anything (scripts/run.py: a model on a Redis group
the settings lack, a model file that is not there) is not started again to stop on it again,
for ever: its keeper says why, once, and starts it when the check passes again (the file
fixed), the rest of the stack serving meanwhile.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

FIRST_PAUSE_S = 1.0
LONGEST_PAUSE_S = 30.0
# A process that ran this long before it exited is started again after the first pause.
STEADY_S = 60.0
CHECKED = ("web", "worker", "webhooks", "flower")
RECHECK_S = 5.0


def config_problem(env: dict[str, str], devices: bool = False) -> str:
    """Why a part with environment `env` would stop at its start on its settings or models
    file, in one line ("" : it would not). `devices`: also a model on a device this host
    lacks (the worker's children could not load it)."""
    from config import ConfigError, load_settings
    from config.models import read_models_content
    from scripts.models_check import problems_of
    from workers.child.devices import visible_gpu_count

    try:
        settings = load_settings(environ=env)
        problems = problems_of(Path(settings.models_file),
                               read_models_content(settings.models_file),
                               settings.redis_group_urls,
                               host_gpus=visible_gpu_count(settings) if devices else None)
    except ConfigError as exc:
        return str(exc).splitlines()[0]
    return problems[0] if problems else ""


# config_problem in a process of the part's user (`checked_as`).
_CHECK = "import os, sys; from scripts.respawn import config_problem; " \
         "print(config_problem(dict(os.environ), sys.argv[1] == 'devices'))"


def checked_as(switch: dict[str, object]) -> Callable[[dict[str, str], bool], str]:
    """config_problem as the part's user (`switch`: scripts/run_users.py), for a keeper that
    starts its part as another user: a settings or models file that user cannot read fails it
    as it fails the part (root reads it), and the models file's `kinds:` modules, which are
    code, are not imported as root."""
    def check(env: dict[str, str], devices: bool = False) -> str:
        probe = subprocess.run([sys.executable, "-c", _CHECK, "devices" if devices else ""],
                               env=env, capture_output=True, text=True,
                               **switch)  # type: ignore[arg-type]
        if probe.returncode:  # it could not even check: that is its reason
            return (probe.stderr.strip().splitlines()
                    or [f"the check exited with code {probe.returncode}"])[-1]
        return probe.stdout.strip()

    return check


def held(name: str, env: dict[str, str], stopping: threading.Event, code: int,
         check: Callable[[dict[str, str], bool], str] = config_problem) -> bool:
    """Wait while the part's configuration fails its check (saying so once); whether it is
    to be started again (else it was stopped meanwhile)."""
    devices = name == "worker"
    why = check(env, devices) if name in CHECKED else ""
    if not why:
        return True
    print(f"{name} exited with code {code}; it is not started again while its configuration "
          f"fails make run's check: "
          f"{why} (fix it: {name} starts once it passes; Ctrl-C stops them all)", flush=True)
    while not stopping.wait(RECHECK_S):
        if not check(env, devices):
            print(f"{name}: its configuration passes the check again; starting it", flush=True)
            return True
    return False


def main(argv: list[str]) -> int:
    switch: dict[str, object] = {}
    if len(argv) == 5 and argv[1] == "--user":
        from scripts.run_users import switch as user_switch

        switch, argv = user_switch(argv[2]), argv[2:]
    if len(argv) != 3:
        print("usage: python -m scripts.respawn [--user USER] NAME COMMAND", file=sys.stderr)
        return 2
    name, command = argv[1], argv[2]
    stopping = threading.Event()

    def stop(_signum: int, _frame: object) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGQUIT, stop)  # a quick stop (make run's for the API) is a stop too
    pause, env = FIRST_PAUSE_S, dict(os.environ)
    while True:
        started = time.monotonic()
        code = subprocess.call(["/bin/sh", "-c", command], env=env,
                               **switch)  # type: ignore[arg-type]
        env["IQ_RESPAWN_LAST_EXIT"] = str(code)
        if stopping.is_set():
            return code
        ran = time.monotonic() - started
        if not held(name, env, stopping, code, checked_as(switch) if switch else config_problem):
            return code
        pause = FIRST_PAUSE_S if ran >= STEADY_S else min(pause * 2, LONGEST_PAUSE_S)
        print(f"{name} exited with code {code} after {ran:.0f}s; starting it again in "
              f"{pause:.0f}s (make run keeps every process up; Ctrl-C stops them all)",
              flush=True)
        if stopping.wait(pause):
            return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
