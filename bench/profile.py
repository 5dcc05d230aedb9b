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
    """Sample `pid` for `seconds` in the background (only the threads on CPU). py-spy pauses
    the process for each sample: without that, a sample taken while the stack changes is
    torn and lands in the wrong function."""
    return subprocess.Popen([py_spy(), "record", "--pid", str(pid), "--duration",
                             str(max(1, round(seconds))), "--rate", str(RATE), "--format",
                             "raw", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _frame(raw: str) -> str:
    m = _FRAME.match(raw.strip())
    return f"{m['name']} ({m['file']})" if m else raw.strip()


PROJECT = ("(app/", "(tasks/", "(workers/")

# What a sample's CPU was for: the innermost frame (leaf first) matching a rule names it, the
# last rules of each list (FALLBACKS of them: the server's and the event loop's own frames,
# which every sample passes through) only where no other rule matched; "other" where none
# did. Function names of this service's commits and of Celery, kombu, gunicorn.
FALLBACKS = 2
API_COSTS = [
    ("submit: the job state's script (Redis round trip)", r"JobState\.submit |JobStore\.submit "
     r"\(app/store"),
    ("job read for the answer (Redis round trip)", r"JobState\.read |JobStore\.get |"
     r"JobStore\.wait |Watch\.until_terminal"),
    ("request body and validation (JSON, marshmallow)", r"validate_job|_request_body|"
     r"_json_body|\(marshmallow/|\(webargs/"),
    ("task message built", r"task_message|send_task|as_task_v2"),
    ("per-request metrics", r"ApiMetrics|\(prometheus_client/"),
    ("logging", r"\(logging/"),
    ("result listener (pub/sub)", r"ResultWaiter\._listen"),
    ("Flask, flask-smorest, werkzeug", r"\(flask/|\(flask_smorest/|\(werkzeug/"),
    ("HTTP server: gunicorn, gevent, threads", r"\(gunicorn/|\(gevent/|\(concurrent/|"
     r"\(threading\.py|\(selectors\.py"),
]
WORKER_COSTS = [
    ("task events: publish", r"EventDispatcher\.flush|EventDispatcher\._publish|"
     r"_flush_events"),
    ("task events: build", r"send_event|EventDispatcher\.send"),
    ("unacked record (and taking what waits)", r"QoS\.append|_record_and_take_more"),
    ("acks", r"Leases\.|Unacked\.|QoS\.ack|Message\.ack|basic_ack"),
    ("logging", r"\(logging/"),
    ("Celery request and the batching strategy", r"task_message_handler|on_task_received|"
     r"_receive_callback|Request\.__init__|\(workers/policy"),
    ("batch to the pool child", r"\(billiard/compat|_write_job|schedule_writes|apply_async|"
     r"PoolDispatcher\._apply |PoolDispatcher\.pump"),
    ("results back from the child, per-job bookkeeping", r"ResultHandler|on_return|"
     r"PoolDispatcher\._finish|_apply\.<locals>\.finish|on_success|on_accepted"),
    ("BRPOP: read, re-issue", r"_brpop_read|_brpop_start|_register_BRPOP|on_poll_start|"
     r"MultiChannelPoller"),
    ("timers: leases, heartbeats, watchdog", r"fire_timers|Timer\.|PoolDispatcher\.tick"),
    ("event loop poll", r"_epoll\.poll|\(kombu/asynchronous/hub"),
]


def _stacks(raw: Path) -> list[tuple[list[str], int]]:
    out = []
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out.append((stack.split(";"), int(count)))
    return out


def costs(raw: Path, jobs: int, rules: list[tuple[str, str]]) -> list[tuple[str, float]]:
    """ms of CPU per job by what it was for (`rules`: name, pattern), costliest first."""
    compiled = [(name, re.compile(pattern)) for name, pattern in rules]
    tiers = (compiled[:-FALLBACKS], compiled[-FALLBACKS:])
    found: Counter[str] = Counter()
    for frames, count in _stacks(raw):
        name = next((name for tier in tiers for frame in reversed(frames)
                     for name, rule in tier if rule.search(frame)), "other")
        found[name] += count
    per_job = 1000 / RATE / max(jobs, 1)
    return [(name, round(c * per_job, 3)) for name, c in found.most_common()]


def top(raw: Path, jobs: int, n: int = 15) -> dict:
    """The `n` costliest functions of a raw py-spy file in ms of CPU per job: by total
    (inclusive; leaving out the frames nearly every sample passes through, the server's and
    the event loop's own), by self time, and this project's own functions by total."""
    totals: Counter[str] = Counter()
    selves: Counter[str] = Counter()
    samples = 0
    for stack, c in _stacks(raw):
        frames = [_frame(f) for f in stack]
        # The first frame is the thread (`process 123:"name"`); not a function.
        frames = [f for f in frames[1:] if f] if frames[0].startswith("process ") else frames
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
