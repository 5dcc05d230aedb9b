"""What a played game day measured, and whether it met its targets; where one fell short, which
fault.

* **Availability**: the share of arrivals whose submit got a job id within 5 s, retries
  included.
* **Lost**: accepted (a job id came back, or its Idempotency-Key made a job though no answer
  did) and not final in Redis once the drain is over and the late jobs have stopped finishing
  (`play.read_back`).
* **Run twice**: the job's record counts its runs (`runs`, one per start of it by a pool
  child); more than one is allowed only to the jobs a killed child was running (or the child
  of a host cut off: its results cannot reach Redis).
* **5xx**: every 5xx the clients' sessions got, and those that reached a caller (a 503 with
  `Retry-After` is retried by the client; what it gives up on, and any other 5xx, reaches
  the caller).
* **Latency**: arrival (as scheduled: open loop) to the final answer, per minute of arrival,
  and inside and outside each fault's window. A job is inside a window when its life (arrival
  to answer) overlaps it; a job never answered, inside the first window it overlaps.
* **Recovery**: from the injection to the start of the first of two 5 s arrival bins in a row
  whose p99 is under the fault's pre-fault level (p99 of the 30 s before it, times
  RECOVERY_SLACK); a job not answered in time counts as infinitely slow. A fault's window runs
  from its injection until it recovered and the stack serves again, whichever is later.
* **Phases** of a succeeded job's latency (`PHASES`, ms; they add up to it): `late`, arrival
  as scheduled to its user's start (the traffic process's own lag); `submit`, to the job's
  `created_at`; `queued`, to its `started_at` (in Redis, in the worker's buffer, the batching
  window); `run`, to its `finished_at` (the batch's model call); `answer`, to the final answer
  in the user's hands (a waiting request's wake-up, the response). Server times are the API's
  (wall clock, milliseconds), the client's `time.time()` beside them: one machine, one clock.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime

from bench.gameday.play import Played, Struck

TERMINAL = {"succeeded", "failed", "cancelled", "expired"}
ACCEPT_WITHIN_S = 5.0
BIN_S = 5.0
PRE_FAULT_S = 30.0
RECOVERY_SLACK = 1.25  # a 5 s bin's p99 is its 2nd or 3rd slowest job: noisy
LIMITS = {"availability": 0.999, "lost": 0, "caller_5xx": 0, "p99_outside_ms": 200,
          "recovery_s": 60, "twice_unexplained": 0}


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (math.inf for a job never answered is kept, not averaged)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)]


def spread(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": _ms(pct(values, 50)), "p99_ms": _ms(pct(values, 99)),
            "p99_9_ms": _ms(pct(values, 99.9)), "max_ms": _ms(max(values, default=None))}


def _ms(value: float | None) -> float | None:
    return None if value is None or math.isinf(value) else round(value, 1)


@dataclass
class Job:
    at: float  # arrival, seconds into the run
    until: float  # answered (or the run's end, if never)
    ms: float  # latency; math.inf unless it succeeded and its answer came back
    accepted_in: float | None  # seconds from arrival to its job id
    lost: bool
    final: bool  # its record read back in a final status (answered in time or not)
    runs: int
    id: str | None
    caller_5xx: bool
    windows: list[int] = field(default_factory=list)  # the fault windows it was in (place)
    inputs: int = 1
    phases: dict[str, float] | None = None  # ms each (PHASES), when it succeeded


PHASES = ("late", "submit", "queued", "run", "answer")
_WALL = ("started_wall", "created_at", "started_at", "finished_at", "done_wall")


def phases_of(row: dict) -> dict[str, float] | None:
    """A succeeded job's latency split into PHASES (ms); None without every time."""
    times = [row.get(k) for k in _WALL]
    if row.get("status") != "succeeded" or None in times or row.get("done") is None:
        return None
    wall = [times[0], *(datetime.fromisoformat(t).timestamp() for t in times[1:4]), times[4]]
    steps = [(b - a) * 1000 for a, b in zip(wall, wall[1:])]
    return dict(zip(PHASES, [(row["started"] - row["arrival"]) * 1000, *steps]))


def by_phase(jobs: list[Job]) -> dict[str, dict]:
    """Per job size: each phase's spread, and where the time of its slowest jobs (at or over
    that size's p99) went (mean ms a phase)."""
    out = {}
    for n in sorted({j.inputs for j in jobs if j.phases}):
        these = [j for j in jobs if j.inputs == n and j.phases]
        p99 = pct([j.ms for j in these], 99)
        slow = [j for j in these if j.ms >= p99]
        out[str(n)] = {
            "n": len(these), **{ph: spread([j.phases[ph] for j in these]) for ph in PHASES},
            "slowest": {"n": len(slow), "ms": _mean([j.ms for j in slow]),
                        **{ph: _mean([j.phases[ph] for j in slow]) for ph in PHASES}}}
    return out


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 1)


def jobs_of(played: Played) -> list[Job]:
    out = []
    for row in played.jobs:
        record = played.records.get(row.get("id")) or played.unanswered.get(row["token"]) or {}
        done = row.get("done")
        ok = row.get("status") == "succeeded" and done is not None
        out.append(Job(
            at=row["arrival"] - played.start,
            until=(done if done is not None else math.inf) - played.start,
            ms=(done - row["arrival"]) * 1000 if ok else math.inf,
            accepted_in=row["accepted"] - row["arrival"] if row.get("accepted") else None,
            lost=bool(record) and record["status"] not in TERMINAL,
            final=record.get("status") in TERMINAL,
            runs=record.get("runs", 0), id=row.get("id") or record.get("id"),
            caller_5xx=(row.get("http_status") or 0) >= 500, inputs=row.get("inputs", 1),
            phases=phases_of(row)))
    return out


@dataclass
class Window:
    struck: Struck
    at: float
    end: float
    pre_p99: float | None
    recovery: float | None


def windows(played: Played, jobs: list[Job]) -> list[Window]:
    out: list[Window] = []
    run_end = played.end - played.start
    for i, s in enumerate(played.struck):
        at = s.injected - played.start
        limit = (played.struck[i + 1].injected - played.start) if i + 1 < len(played.struck) \
            else run_end
        pre = pct(_before(jobs, at, out), 99)
        recovery = _recovery(jobs, at, limit, pre)
        serving = None if s.serving is None else s.serving - played.start
        ends = [x for x in (serving, None if recovery is None else at + recovery)
                if x is not None]
        end = max(ends) if len(ends) == 2 else limit
        out.append(Window(s, at, end, pre, recovery))
    return out


def _before(jobs: list[Job], at: float, earlier: list[Window]) -> list[float]:
    """The pre-fault latencies: jobs of the 30 s before `at` answered before it (not those
    the fault caught in flight), outside the earlier faults' windows where there are
    enough of those."""
    answered = [j for j in jobs if at - PRE_FAULT_S <= j.at and j.until < at]
    calm = [j for j in answered if not any(overlaps(j, w) for w in earlier)]
    return [j.ms for j in (calm if len(calm) >= 20 else answered)]


def _recovery(jobs: list[Job], at: float, limit: float, pre: float | None) -> float | None:
    if pre is None or math.isinf(pre):
        return None
    bins = []
    start = at
    while start < limit:
        bins.append(pct([j.ms for j in jobs if start <= j.at < start + BIN_S], 99))
        start += BIN_S
    level = pre * RECOVERY_SLACK
    for i in range(len(bins) - 1):
        if all(b is not None and b <= level for b in bins[i:i + 2]):
            return i * BIN_S
    return None


def overlaps(job: Job, w: Window) -> bool:
    return job.at <= w.end and job.until >= w.at


def place(jobs: list[Job], ws: list[Window]) -> None:
    """Each job's windows: those its life overlaps; for a job never answered, only the first
    (the fault it was caught by, not every later one)."""
    for j in jobs:
        hit = [i for i, w in enumerate(ws) if overlaps(j, w)]
        j.windows = hit[:1] if math.isinf(j.until) else hit


def analyse(played: Played) -> dict:
    jobs = jobs_of(played)
    ws = windows(played, jobs)
    allowed = {job_id for s in played.struck for job_id in s.may_rerun}
    place(jobs, ws)
    outside = [j for j in jobs if not j.windows]
    wire = played.summary["server_errors"]
    faults = [_fault(w, [j for j in jobs if i in j.windows], wire, allowed, played.start)
              for i, w in enumerate(ws)]
    twice = [j for j in jobs if j.runs > 1]
    report = {
        "jobs": {"arrivals": len(jobs), "accepted": sum(j.id is not None for j in jobs),
                 "succeeded": sum(not math.isinf(j.ms) for j in jobs),
                 "final": sum(j.final for j in jobs),
                 "lost": sum(j.lost for j in jobs),
                 "lost_ids": [j.id for j in jobs if j.lost][:50],
                 "never_answered": sum(j.accepted_in is None for j in jobs),
                 "made_without_answer": len(played.unanswered),
                 "read_back_waited_s": round(played.settled_s, 1),
                 "run_twice": len(twice),
                 "run_twice_in_killed_batches": sum(j.id in allowed for j in twice),
                 "run_twice_unexplained": sum(j.id not in allowed for j in twice),
                 "run_twice_unexplained_ids": [j.id for j in twice if j.id not in allowed][:50]},
        "availability": _share(sum(_available(j) for j in jobs), len(jobs)),
        "answers": played.summary["answers"],
        "server_errors": {"answers": _by_code(wire), "reached_caller":
                          sum(j.caller_5xx for j in jobs)},
        "client_retries": len(played.summary["retries"]),
        "latency": {"all": spread([j.ms for j in jobs]), "outside_faults": spread(
            [j.ms for j in outside]), "outside_faults_by_inputs": {
                str(n): spread([j.ms for j in outside if j.inputs == n])
                for n in sorted({j.inputs for j in outside})},
            "outside_faults_by_phase": by_phase(outside), "per_minute": _per_minute(jobs)},
        "series": _series(jobs),
        "cpu": {"columns": ["s", "machine %", "stack %", "load average (1 min)"],
                "samples": played.cpu},
        "faults": faults,
    }
    report["targets"] = targets(report, jobs, ws, allowed)
    return report


def _available(job: Job) -> bool:
    return job.accepted_in is not None and job.accepted_in <= ACCEPT_WITHIN_S


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 6) if whole else None


def _by_code(answers: list) -> dict[str, int]:
    out: dict[str, int] = {}
    for _t, method, code in answers:
        out[f"{method} {code}"] = out.get(f"{method} {code}", 0) + 1
    return out


def _fault(w: Window, hit: list[Job], wire: list, allowed: set, start: float) -> dict:
    """A fault's figures, over the jobs in its window (`hit`)."""
    s = w.struck
    return {
        "name": s.name, "label": s.label, "at_s": round(w.at, 1),
        "late_s": round(s.injected - s.scheduled, 1), "over_s": round(s.over - s.injected, 1),
        "serving_s": None if s.serving is None else round(s.serving - s.injected, 1),
        "recovery_s": w.recovery, "window_s": [round(w.at, 1), round(w.end, 1)],
        "pre_fault_p99_ms": _ms(w.pre_p99), "latency": spread([j.ms for j in hit]),
        "unavailable": sum(not _available(j) for j in hit),
        "lost": sum(j.lost for j in hit),
        "server_errors": _by_code([a for a in wire if w.at <= a[0] - start <= w.end]),
        "caller_5xx": sum(j.caller_5xx for j in hit),
        "killed_batch_jobs": len(s.may_rerun),
        "run_twice_unexplained": sum(j.runs > 1 and j.id not in allowed for j in hit),
        "notes": s.notes,
    }


def _per_minute(jobs: list[Job]) -> list[dict]:
    minutes = int(max((j.at for j in jobs), default=0) // 60) + 1
    out = []
    for m in range(minutes):
        these = [j for j in jobs if m * 60 <= j.at < (m + 1) * 60]
        out.append({"minute": m, **spread([j.ms for j in these]),
                    "availability": _share(sum(_available(j) for j in these), len(these))})
    return out


def _series(jobs: list[Job]) -> list[list]:
    """Per 5 s of arrivals: its start, p50, p99, jobs, jobs not answered: the picture's
    lines."""
    bins: dict[int, list[Job]] = {}
    for j in jobs:
        bins.setdefault(int(j.at // BIN_S), []).append(j)
    return [[k * BIN_S, _ms(pct([j.ms for j in b], 50)), _ms(pct([j.ms for j in b], 99)),
             len(b), sum(math.isinf(j.ms) for j in b)] for k, b in sorted(bins.items())]


def targets(report: dict, jobs: list[Job], ws: list[Window], allowed: set) -> list[dict]:
    """The issue's targets, each with where it fell short (which fault) when it did."""
    def where(miss) -> list[str]:
        counts = [(w.struck.name, sum(miss(j) for j in jobs if i in j.windows))
                  for i, w in enumerate(ws)]
        apart = sum(miss(j) for j in jobs if not j.windows)
        return [f"{name} ({n})" for name, n in counts + [("outside every fault window", apart)]
                if n]

    recoveries = [f["recovery_s"] for f in report["faults"]]
    rows = [
        ("availability (id within 5 s)", report["availability"], ">=",
         LIMITS["availability"], lambda: where(lambda j: not _available(j))),
        ("jobs lost", report["jobs"]["lost"], "<=", LIMITS["lost"],
         lambda: where(lambda j: j.lost)),
        ("5xx reaching a caller", report["server_errors"]["reached_caller"], "<=",
         LIMITS["caller_5xx"], lambda: where(lambda j: j.caller_5xx)),
        ("p99 outside fault windows (ms)", report["latency"]["outside_faults"]["p99_ms"], "<=",
         LIMITS["p99_outside_ms"], lambda: ["outside every fault window"]),
        ("slowest recovery (s)", None if None in recoveries else max(recoveries, default=0),
         "<=", LIMITS["recovery_s"], lambda: [
             f"{f['name']} ({'not recovered' if f['recovery_s'] is None else f['recovery_s']})"
             for f in report["faults"]
             if f["recovery_s"] is None or f["recovery_s"] > LIMITS["recovery_s"]]),
        ("runs twice outside a killed or cut-off batch", report["jobs"]["run_twice_unexplained"],
         "<=", LIMITS["twice_unexplained"],
         lambda: where(lambda j: j.runs > 1 and j.id not in allowed)),
    ]
    out = []
    for name, value, op, limit, blame in rows:
        ok = value is not None and (value >= limit if op == ">=" else value <= limit)
        out.append({"target": name, "measured": value, "op": op, "limit": limit,
                    "pass": ok, "where": [] if ok else blame()})
    return out
