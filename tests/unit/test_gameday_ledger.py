"""The game day's ledger on a run made up here (and what its table says): what counts as lost,
unavailable, run twice, recovered, and which fault a miss is blamed on. No stack: the ledger only
reads what a run recorded."""
from __future__ import annotations

import itertools
from datetime import datetime, timedelta, timezone

from bench.gameday.ledger import PHASES, analyse
from bench.gameday.play import Played, Struck
from bench.gameday.report import markdown, table
from tasks.jobstate import iso

START = 1000.0  # time.monotonic() of the run's first second, as recorded


def job(seq: int, at: float, ms: float | None, accepted_after: float = 0.01,
        status: str = "succeeded", runs: int = 1, record: str = "succeeded") -> tuple:
    """A row as the traffic writes it and the record read back from Redis."""
    row = {"seq": seq, "token": f"gd-t-{seq}", "style": "prefer-wait", "inputs": 1,
           "arrival": START + at, "started": START + at,
           "accepted": START + at + accepted_after, "id": f"job-{seq}"}
    if ms is not None:
        row.update(done=START + at + ms / 1000, status=status)
    else:
        row.update(status="queued", error="WaitTimeout")
    return row, {"status": record, "runs": runs}


def fault(name: str, at: float, serving_after: float = 1.0, may_rerun=()) -> Struck:
    return Struck(name, name, START + at, START + at, START + at, START + at + serving_after,
                  list(may_rerun), [])


def played(rows: list[tuple], struck: list[Struck], seconds: float = 120,
           server_errors=()) -> Played:
    p = Played(rate=10, start=START, end=START + seconds, jobs=[r for r, _ in rows],
               summary={"answers": {}, "server_errors": list(server_errors), "retries": []},
               struck=struck)
    p.records = {r["id"]: record for r, record in rows if "id" in r}
    return p


def steady(until: float, ms: float = 50, every: float = 0.1, skip=()) -> list[tuple]:
    """A job every `every` seconds answered in `ms`, from 0 to `until` (not at `skip`)."""
    n = int(until / every)
    return [job(i, i * every, ms) for i in range(n) if i not in skip]


def test_a_steady_run_with_no_fault_meets_every_target():
    report = analyse(played(steady(120), []))
    assert report["availability"] == 1.0
    assert report["jobs"]["lost"] == 0 and report["jobs"]["arrivals"] == 1200
    assert report["latency"]["outside_faults"]["p99_ms"] == 50
    assert [m["n"] for m in report["latency"]["per_minute"]] == [600, 600]
    assert all(t["pass"] for t in report["targets"]), report["targets"]


def test_recovery_is_when_p99_is_back_under_its_pre_fault_level():
    # At 60 s a fault: jobs arriving in the next 12 s take 2 s, then 50 ms again.
    rows = [job(i, i * 0.1, 2000 if 60 <= i * 0.1 < 72 else 50) for i in range(1200)]
    report = analyse(played(rows, [fault("redis-frozen", 60, serving_after=3)]))
    [f] = report["faults"]
    assert f["pre_fault_p99_ms"] == 50
    assert f["recovery_s"] == 15  # the bin from 75 s is the first clean one (70-75 holds 2 s)
    assert f["window_s"] == [60, 75]
    assert f["latency"]["p99_ms"] == 2000
    # Outside every window the slow jobs are gone; the target holds.
    assert report["latency"]["outside_faults"]["p99_ms"] == 50
    recovered = next(t for t in report["targets"] if t["target"] == "slowest recovery (s)")
    assert recovered["pass"] and recovered["measured"] == 15


def test_a_fault_never_recovered_is_a_miss_that_names_it():
    rows = [job(i, i * 0.1, 3000 if i * 0.1 >= 60 else 50) for i in range(1200)]
    report = analyse(played(rows, [fault("worker-killed", 60)]))
    recovered = next(t for t in report["targets"] if t["target"] == "slowest recovery (s)")
    assert not recovered["pass"] and recovered["where"] == ["worker-killed (not recovered)"]
    assert report["faults"][0]["window_s"] == [60, 120]  # to the end of the run


def test_a_lost_job_is_blamed_on_the_first_fault_it_lived_through():
    rows = steady(120, skip={500})
    rows.append(job(500, 50.0, None, record="queued"))  # accepted, never final
    report = analyse(played(rows, [fault("child-killed", 55), fault("redis-restart", 90)]))
    assert report["jobs"]["lost"] == 1 and report["jobs"]["lost_ids"] == ["job-500"]
    assert [f["lost"] for f in report["faults"]] == [1, 0]
    lost = next(t for t in report["targets"] if t["target"] == "jobs lost")
    assert not lost["pass"] and lost["where"] == ["child-killed (1)"]


def test_a_job_final_in_redis_is_not_lost_though_its_answer_never_came():
    rows = steady(120, skip={500})
    rows.append(job(500, 50.0, None, record="succeeded"))
    report = analyse(played(rows, []))
    assert report["jobs"]["lost"] == 0
    assert report["jobs"]["succeeded"] == 1199  # answered to its user
    assert report["jobs"]["final"] == 1200  # read back final


def test_a_submit_answered_after_five_seconds_is_unavailable_and_blamed():
    rows = steady(120, skip={700, 701, 702})
    rows += [job(700, 70.0, 6500, accepted_after=6.0), job(701, 70.1, 200, accepted_after=4.9),
             job(702, 70.2, 6500, accepted_after=5.5)]
    report = analyse(played(rows, [fault("redis-frozen", 69)]))
    assert report["availability"] == round(1198 / 1200, 6)
    assert report["faults"][0]["unavailable"] == 2
    available = report["targets"][0]
    assert not available["pass"] and available["where"] == ["redis-frozen (2)"]


def test_only_jobs_of_a_killed_batch_may_run_twice():
    rows = steady(120, skip={300, 301})
    rows += [job(300, 30.0, 900, runs=2), job(301, 30.0, 900, runs=2)]
    report = analyse(played(rows, [fault("child-killed", 30.2, may_rerun=["job-300"])]))
    jobs = report["jobs"]
    assert jobs["run_twice"] == 2 and jobs["run_twice_in_killed_batches"] == 1
    assert jobs["run_twice_unexplained_ids"] == ["job-301"]
    twice = report["targets"][-1]
    assert not twice["pass"] and twice["where"] == ["child-killed (1)"]


def test_server_errors_are_counted_on_the_wire_and_where_they_reach_a_caller():
    rows = steady(120, skip={400})
    row, record = job(400, 40.0, None, record="missing")
    del row["accepted"], row["id"]
    row.update(status="error", error="Unavailable: redis down", http_status=503)
    rows.append((row, record))
    wire = [(START + 40.5, "POST", 503), (START + 41.0, "POST", 503)]
    report = analyse(played(rows, [fault("redis-restart", 40)], server_errors=wire))
    assert report["server_errors"] == {"answers": {"POST 503": 2}, "reached_caller": 1}
    assert report["faults"][0]["server_errors"] == {"POST 503": 2}
    assert report["jobs"]["never_answered"] == 1 and report["jobs"]["lost"] == 0
    caller = next(t for t in report["targets"] if t["target"] == "5xx reaching a caller")
    assert not caller["pass"] and caller["where"] == ["redis-restart (1)"]


def test_the_table_and_the_results_say_how_loaded_the_machine_was():
    p = played(steady(120), [])
    p.cpu = [[1.0, 150, 90, 6.5], [2.0, 190, 95, 9.5]]
    report = {"run": {"started": "2026-12-04T05:00:00Z", "model": "m", "rate": 10.0,
                      "rate_source": "given", "seconds": 120.0, "load_before": [4.0, 3.0, 2.0],
                      "machine": "here"}, **analyse(p)}
    expected = "load average (1 min) 8.0 mean, 9.5 most (before the stack started, 1/5/15 " \
               "min: 4.00/3.00/2.00)"
    assert expected in table(report)
    assert expected in markdown(report, "x.png")


def test_outside_the_fault_windows_latency_is_split_by_job_size():
    """Where the p99 outside the windows comes from: one-input jobs and many-input jobs
    apart, in the JSON, the terminal table and the README block."""
    rows = steady(120)
    for i, (row, _record) in enumerate(rows):
        if i % 10 == 0:  # a sixteen-input job every second, answered in 400 ms
            row.update(inputs=16, done=row["arrival"] + 0.4)
    report = {"run": {"started": "2026-12-04T05:00:00Z", "model": "m", "rate": 10.0,
                      "rate_source": "given", "seconds": 120.0, "load_before": [0.1] * 3,
                      "machine": "here"}, **analyse(played(rows, []))}
    by = report["latency"]["outside_faults_by_inputs"]
    assert {n: (s["n"], s["p99_ms"]) for n, s in by.items()} == {"1": (1080, 50),
                                                                  "16": (120, 400)}
    assert report["latency"]["outside_faults"]["p99_ms"] == 400
    assert "by inputs a job, 1: 50/50/50 ms (1,080), 16: 400/400/400 ms (120)" in \
        markdown(report, "x.png")
    assert "16: 400/400/400 ms (120)" in table(report)


WALL = 1_800_000_000  # time.time() at START, whole seconds


def timed(row: dict, late: int, submit: int, queued: int, run: int, answer: int) -> None:
    """Give a row the times its phases come from, in ms after its arrival: the client's
    (monotonic and wall clock) and the final answer's (ISO, as the API writes them)."""
    at_ms = round((row["arrival"] - START) * 1000)
    marks = list(itertools.accumulate([at_ms + late, submit, queued, run, answer]))
    row.update(started=START + marks[0] / 1000, started_wall=WALL + marks[0] / 1000,
               done=START + marks[4] / 1000, done_wall=WALL + marks[4] / 1000,
               **{k: iso(datetime.fromtimestamp(WALL, timezone.utc) + timedelta(milliseconds=m))
                  for k, m in zip(("created_at", "started_at", "finished_at"), marks[1:4])})


def test_outside_the_fault_windows_each_phase_of_a_job_is_measured_by_job_size():
    """Where a slow job's time goes: each phase's spread per job size, and the mean of each
    phase over the slowest 1 %, in the JSON, the terminal table and the README block."""
    rows = steady(120)
    for i, (row, _record) in enumerate(rows):
        if i % 10 == 0:  # sixteen inputs: a longer model call
            row["inputs"] = 16
            timed(row, 1, 4, 20, 215, 10)
        elif i % 100 == 5:  # twelve one-input jobs held queued
            timed(row, 1, 4, 300, 15, 10)
        elif i % 100 == 7:  # twelve one-input jobs whose answer came late
            timed(row, 1, 4, 20, 15, 200)
        else:
            timed(row, 1, 4, 20, 15, 10)
    del rows[3][0]["started_at"]  # an answer without its times: not split, still counted
    report = {"run": {"started": "2026-12-04T05:00:00Z", "model": "m", "rate": 10.0,
                      "rate_source": "given", "seconds": 120.0, "load_before": [0.1] * 3,
                      "machine": "here"}, **analyse(played(rows, []))}
    assert report["latency"]["outside_faults_by_inputs"]["1"]["p99_ms"] == 330
    by = report["latency"]["outside_faults_by_phase"]
    one, sixteen = by["1"], by["16"]
    assert one["n"] == 1079 and sixteen["n"] == 120
    assert {ph: (one[ph]["p50_ms"], one[ph]["p99_ms"]) for ph in PHASES} == {
        "late": (1, 1), "submit": (4, 4), "queued": (20, 300), "run": (15, 15),
        "answer": (10, 200)}
    # The slowest 1 % (at or over the p99, 330 ms): the twelve held queued.
    assert one["slowest"] == {"n": 12, "ms": 330, "late": 1, "submit": 4, "queued": 300,
                              "run": 15, "answer": 10}
    assert (sixteen["run"]["p99_ms"], sixteen["slowest"]["n"]) == (215, 120)
    assert "    1 input(s), 1,079 jobs: late 1/1, submit 4/4, queued 20/300, run 15/15, " \
           "answer 10/200; slowest 12 (330 ms): 1/4/300/15/10" in table(report)
    assert "| 16 | 120 | 1 / 1 | 4 / 4 | 20 / 20 | 215 / 215 | 10 / 10 | 120, 250: " \
           "1 / 4 / 20 / 215 / 10 |" in markdown(report, "x.png")
