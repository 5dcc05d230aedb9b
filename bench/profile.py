"""Where a process's CPU goes under load: py-spy samples it (`py-spy record --format raw`,
collapsed stacks), and `top` and `costs` share out the CPU per job measured for that process
(from /proc, not from the samples) by function (self: the function itself; total: it and
what it calls) and by what it was for.

Sample counts alone do not give CPU: py-spy's idle detection is a heuristic and a thread of
a gthread server that waits in a C call can be counted as running. So the samples give only
the shares, and the measured CPU the milliseconds.

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
    """Sample `pid` for `seconds` in the background, only the threads on CPU, without pausing
    it (a paused process's threads all look stopped, so idle ones are sampled too)."""
    return subprocess.Popen([py_spy(), "record", "--pid", str(pid), "--duration",
                             str(max(1, round(seconds))), "--rate", str(RATE), "--format",
                             "raw", "--nonblocking", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _frame(raw: str) -> str:
    m = _FRAME.match(raw.strip())
    return f"{m['name']} ({m['file']})" if m else raw.strip()


PROJECT = ("(app/", "(tasks/", "(workers/", "(deliverer/")

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
    ("unacked record (and taking what waits)", r"QoS\.append|append_or_keep|_record_and_take"),
    ("acks", r"Leases\.|InFlight\.|QoS\.ack|Message\.ack|basic_ack"),
    ("logging", r"\(logging/"),
    ("Celery request and the batching strategy", r"task_message_handler|on_task_received|"
     r"_receive_callback|Request\.__init__|\(workers/(batching/)?policy"),
    ("batch to the pool child", r"\(billiard/compat|_write_job|schedule_writes|apply_async|"
     r"PoolDispatcher\._apply |PoolDispatcher\.pump"),
    ("results back from the child, per-job bookkeeping", r"ResultHandler|on_return|"
     r"PoolDispatcher\._returned|Settlement\.finish|_apply\.<locals>\.finish|on_success|"
     r"on_accepted"),
    ("BRPOP: read, re-issue", r"_brpop_read|_brpop_start|_register_BRPOP|on_poll_start|"
     r"MultiChannelPoller"),
    ("timers: leases, heartbeats, watchdog", r"fire_timers|Timer\.|Liveness\.tick"),
    ("event loop poll", r"_epoll\.poll|\(kombu/asynchronous/hub"),
]


# Leaves of a thread that waits rather than runs, when py-spy's idle check misses it: a
# thread pool's worker blocked in its queue's C `get`, a lock or a selector.
_WAITING = re.compile(r"^(_worker \(concurrent/futures/thread\.py|wait \(threading\.py|"
                      r"select \(selectors\.py|EpollSelector\.select|_epoll\.poll)")


def _stacks(raw: Path) -> list[tuple[list[str], int]]:
    out = []
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            frames = stack.split(";")
            if not _WAITING.match(frames[-1].strip()):
                out.append((frames, int(count)))
    return out


def costs(raw: Path, cpu_ms_per_job: float,
          rules: list[tuple[str, str]]) -> list[tuple[str, float]]:
    """The process's measured `cpu_ms_per_job` shared out by what it was for (`rules`: name,
    pattern) in proportion to the samples, costliest first."""
    compiled = [(name, re.compile(pattern)) for name, pattern in rules]
    tiers = (compiled[:-FALLBACKS], compiled[-FALLBACKS:])
    found: Counter[str] = Counter()
    for frames, count in _stacks(raw):
        name = next((name for tier in tiers for frame in reversed(frames)
                     for name, rule in tier if rule.search(frame)), "other")
        found[name] += count
    per_sample = cpu_ms_per_job / max(sum(found.values()), 1)
    return [(name, round(c * per_sample, 3)) for name, c in found.most_common()]


def top(raw: Path, cpu_ms_per_job: float, n: int = 15) -> dict:
    """The `n` costliest functions of a raw py-spy file, in shares of the process's measured
    `cpu_ms_per_job`: by total
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
    per_job = cpu_ms_per_job / max(samples, 1)

    def ms(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(name, round(c * per_job, 3)) for name, c in counter.most_common(n)]

    shared = Counter({f: c for f, c in totals.items() if c < 0.9 * samples})
    ours = Counter({f: c for f, c in totals.items() if any(p in f for p in PROJECT)})
    return {"samples": samples, "cpu_ms_per_job": cpu_ms_per_job,
            "total": ms(shared), "self": ms(selves), "project": ms(ours)}
