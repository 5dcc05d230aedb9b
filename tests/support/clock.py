"""A process whose wall clock is off by a fixed amount: Debian's `faketime` (libfaketime,
preloaded into the process and every process it starts), installed before the tests by
scripts/test_tools.py. libfaketime moves the monotonic clock with the wall clock (left alone, with
FAKETIME_DONT_FAKE_MONOTONIC, its sleeps fail with EINVAL); a process only compares its own
monotonic readings with each other, so that shift is harmless."""
from __future__ import annotations

import subprocess
import time

from tests.support.tools import require


def skewed(offset_s: int) -> list[str]:
    """A command prefix that runs a command with its wall clock `offset_s` seconds off (ahead
    when positive); checked to work before it is handed out."""
    require("faketime")
    prefix = ["faketime", "-f", f"{offset_s:+d}s"]
    seen = float(subprocess.run([*prefix, "date", "+%s.%N"], check=True, capture_output=True,
                                text=True, timeout=30).stdout)
    assert abs(seen - time.time() - offset_s) < 5, f"faketime gave {seen - time.time():+.1f}s"
    return prefix
