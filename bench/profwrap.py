"""Runs a script under cProfile switched on and off by a signal (SIGRTMIN+1: on; again: off,
the stats dumped to argv[1]): `python -m bench.profwrap OUT SCRIPT ARGS...`. The worker's main
process profiled over the load's window only, its call counts exact (bench/intake_profile.py)."""
from __future__ import annotations

import cProfile
import runpy
import signal
import sys

TOGGLE = signal.SIGRTMIN + 1


def main() -> None:
    out, script = sys.argv[1], sys.argv[2]
    prof = cProfile.Profile()
    on = [False]

    def toggle(_signum, _frame) -> None:
        if on[0]:
            prof.disable()
            prof.dump_stats(out)
        else:
            prof.enable()
        on[0] = not on[0]

    signal.signal(TOGGLE, toggle)
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
