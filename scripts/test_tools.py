"""The system tools the test suite drives, installed once before the tests start (`make test`
runs this first): headless Chromium (the browser's event stream), iptables (network cuts and
hosts of their own) and faketime (skewed clocks), each from Debian's package of that name.

Installing them from inside the tests raced: two test processes ran apt-get at once, one lost
the lock, and its tests skipped as if the machine could not run them. Here they are installed in
one apt-get call, before any test; a test that needs one asks `tests/support/tools.require`,
which fails, naming the tool, where this script could have installed it (as root), and skips
only where it could not (not root, no apt-get).

    python -m scripts.test_tools        # installs what is missing; exit 1 if that failed
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

# The command each test looks for, and the Debian package that has it.
TOOLS = {"chromium": "chromium", "iptables": "iptables", "faketime": "faketime"}


def can_install() -> bool:
    """Whether this machine lets `make test` install packages: root, with apt-get."""
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


def missing() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def install(tools: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    packages = [TOOLS[tool] for tool in tools]
    subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
    return subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends",
                           *packages], capture_output=True, text=True, env=env, timeout=1200)


def main() -> int:
    wanted = missing()
    if not wanted:
        return 0
    if not can_install():
        print(f"make test: {', '.join(wanted)} missing and not installable here (needs root and "
              "apt-get): the tests that drive them will be skipped", file=sys.stderr)
        return 0
    print(f"make test: installing {', '.join(TOOLS[t] for t in wanted)} (Debian) for the tests",
          file=sys.stderr)
    done = install(wanted)
    if still := missing():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        print(f"make test: could not install {', '.join(still)}: apt-get exited "
              f"{done.returncode}: {tail[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
