"""Where a process's CPU goes under load: py-spy samples it (`py-spy record --format raw`,
collapsed stacks), and `top` turns the samples into milliseconds of CPU per job, by
function (self: the function itself; total: it and what it calls).

Used by `python -m bench.cpu --profile DIR`; the raw files stay in DIR for a flame graph
(`flamegraph.pl`, speedscope).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

RATE = 250  # samples a second

# `function (module/file.py:line)` as py-spy writes a frame; the line number is dropped so
# that a function's samples add up across its lines.
_FRAME = re.compile(r"^(?P<name>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def py_spy() -> str:
    found = Path(sys.executable).parent / "py-spy"
    return str(found) if found.exists() else (shutil.which("py-spy") or "py-spy")


def record(pid: int, seconds: float, out: Path) -> subprocess.Popen:
    """Sample `pid` for `seconds` in the background (only the threads on CPU; without
    pausing the process, so that the sampling disturbs it least)."""
    return subprocess.Popen([py_spy(), "record", "--pid", str(pid), "--duration",
                             str(max(1, round(seconds))), "--rate", str(RATE), "--format",
                             "raw", "--nonblocking", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _frame(raw: str) -> str:
    m = _FRAME.match(raw.strip())
    return f"{m['name']} ({m['file']})" if m else raw.strip()


PROJECT = ("(app/", "(tasks/", "(workers/")


def top(raw: Path, jobs: int, n: int = 15) -> dict:
    """The `n` costliest functions of a raw py-spy file in ms of CPU per job: by total
    (inclusive; leaving out the frames nearly every sample passes through, the server's and
    the event loop's own), by self time, and this project's own functions by total."""
    totals: Counter[str] = Counter()
    selves: Counter[str] = Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_frame(f) for f in stack.split(";")]
        # The first frame is the thread (`process 123:"name"`); not a function.
        frames = [f for f in frames[1:] if f] if frames[0].startswith("process ") else frames
        c = int(count)
        samples += c
        for f in set(frames):
            totals[f] += c
        if frames:
            selves[frames[-1]] += c
    per_job = 1000 / RATE / max(jobs, 1)

    def ms(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(name, round(c * per_job, 3)) for name, c in counter.most_common(n)]

    shared = Counter({f: c for f, c in totals.items() if c < 0.9 * samples})
    ours = Counter({f: c for f, c in totals.items() if any(p in f for p in PROJECT)})
    return {"samples": samples, "cpu_ms_per_job": round(samples * per_job, 3),
            "total": ms(shared), "self": ms(selves), "project": ms(ours)}
