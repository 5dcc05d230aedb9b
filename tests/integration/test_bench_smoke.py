"""The benchmark harness works end to end (quick variant). It asserts no speed."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest

from bench.harness import MODELS, JobsNotFinished, run_load
from scripts.stack import ROOT, launch


# 24 s on an idle 2-core machine, 62 s at load 10; bounded by the run's own 240 s, inside the
# suite's 300 s. A run whose jobs never finish stops by itself well before (bench.load's job
# timeout, 30 s).
def test_quick_benchmark_writes_results_and_plot(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "quick.json").read_text())
    synthetic = report["models"]["synthetic"]
    assert [r["batch_size"] for r in synthetic["raw"]["batches"]] == [1, 2, 4, 8, 16, 32]
    assert set(synthetic["configs"]) == {"service", "no-batching", "celery-batches"}
    for name, config in synthetic["configs"].items():
        assert [p["clients"] for p in config["sweep"]] == [1, 4], name
        for point in config["sweep"] + [config["multi"]]:
            assert point["jobs"] > 0 and point["errors"] == 0, (name, point)
            assert point["items_per_s"] > 0 and point["p99_ms"] >= point["p50_ms"] > 0
    assert (tmp_path / "quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cpu_breakdown_accounts_for_every_process_and_matches_the_worker(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.cpu", "--model", "synthetic",
                          "--clients", "4", "--seconds", "2", "--rounds", "1",
                          "--profile", str(tmp_path), "--scripts"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [report] = json.loads(out.stdout)["points"].values()
    assert report["jobs"] > 0
    assert set(report["cpu_ms_per_job"]) == {"redis", "worker main", "worker child", "api"}
    assert all(ms > 0 for ms in report["cpu_ms_per_job"].values()), report
    # The worker's own metrics count the same jobs as the load generator, give or take the
    # ones in flight when the window opened and closed (one per client at each end).
    assert abs(report["items"] - report["jobs"]) <= 2 * report["clients"], report
    assert 1 <= report["mean_batch_items"] <= 4 and 0 < report["model_busy"] <= 1, report
    # Redis's own count of what each job cost it: the submit at least, and the fetch.
    commands = report["redis_commands_per_job"]
    assert commands["evalsha"] >= 1 and commands["brpop"] > 0, commands
    assert report["redis_usec_per_job"]["evalsha"] > 0, report["redis_usec_per_job"]
    # Redis's time by script (the SLOWLOG round), each by its module's name.
    scripts = report["redis_by_script"]["usec_per_job"]
    assert all(scripts.get(f"tasks.job_lua.{name}", 0) > 0 for name in ("START", "FINISH")) \
        and scripts.get("workers.broker.lua.FETCH", 0) > 0, scripts
    # py-spy sampled both processes of the queue path, in this project's code among others.
    for process in ("api", "worker main"):
        profile = report["profile"][process]
        assert profile["samples"] > 0, profile
        assert profile["project"] and all(ms > 0 for _f, ms in profile["project"]), profile


def test_the_moves_alone_are_timed_move_by_move_in_redis():
    out = subprocess.run([sys.executable, "-m", "bench.lua_cost", "--batch", "4", "--batches",
                          "5", "--rounds", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    best = json.loads(out.stdout)["best"]
    assert best["jobs"] == 20, best
    moves = best["moves"]
    for move in ("submit", "fetch", "start", "finish"):
        assert moves[move]["usec_per_job"] > 0 and moves[move]["round_trips_per_batch"] == 1
    # The batch's acknowledgements go with its finish: no round trip of their own.
    assert moves["ack"]["round_trips_per_batch"] == 0 and best["round_trips_per_batch"] == 4


@pytest.mark.skipif(not shutil.which("callgrind_control"), reason="needs valgrind")
def test_the_moves_instructions_are_counted_move_by_move_under_callgrind():
    out = subprocess.run([sys.executable, "-m", "bench.lua_cost", "--batch", "2",
                          "--callgrind", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["jobs"] == 4 and set(report["by_move"]) == {"submit", "fetch", "start",
                                                               "finish"}, report
    assert all(n > 1000 for n in report["by_move"].values()), report


def test_waiting_clients_scenario_runs_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.waiters", "--waiters", "20",
                          "--window", "1", "--designs", "gevent", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [point] = json.loads((tmp_path / "waiters.json").read_text())["results"]["gevent"]
    assert point["waiters"] == 20 and point["waiter_answers"] == {"200": 20}
    for probe in (point["healthz"], point["submit"], point["baseline"]["healthz"]):
        assert probe["n"] > 0 and probe["ok"] == probe["n"], probe
        assert probe["p99_ms"] >= probe["p50_ms"] > 0


@pytest.mark.serial  # its latency split (fetch → start under 20 ms) is a neighbour's to distort
def test_lone_path_marks_each_hop_of_every_job(tmp_path):
    report_file = tmp_path / "lone.json"
    out = subprocess.run([sys.executable, "-m", "bench.lone_path", "--jobs", "20",
                          "--out", str(report_file)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(report_file.read_text())
    assert report["jobs"] == report["traced"] == 20, report
    ms = report["ms"]
    assert all(ms[name]["p50"] > 0 for name in ms), ms
    # The synthetic model sleeps 20 ms a batch: inside start → finish, and nowhere else.
    assert ms["start → finish"]["p50"] >= 20 > ms["fetch → start"]["p50"], ms
    parts = sum(v["mean"] for name, v in ms.items() if name != "total")
    assert abs(parts - ms["total"]["mean"]) < 0.01, ms
    # Inside the stretches: each script's own time in Redis, and the finish's reply to the
    # client, within the stretch it belongs to; the total over the model's 20.2 ms sleep.
    detail = report["detail_ms"]
    assert set(detail) == {"submit script", "fetch → main's next wait", "finish script",
                           "finish's reply → client"}, detail
    assert 0 < detail["finish script"]["p50"] < ms["finish → client"]["p50"], report
    assert 0 < detail["finish's reply → client"]["p50"] < ms["finish → client"]["p50"], report
    assert report["model_ms"] == 20.2
    assert abs(report["over_model_ms"]["mean"] - (ms["total"]["mean"] - 20.2)) < 0.01, report


def test_a_round_whose_jobs_never_finish_stops_with_an_error(tmp_path):
    """A stack that takes jobs but never finishes them (as the celery-batches peer did when it
    dropped every message's job token; here, no worker at all) ends the round once a job is
    past the load generator's job timeout, with an error naming the job, instead of hanging
    the benchmark (each client would wait on its job for ever)."""
    stack = launch(tmp_path, {"synthetic": MODELS["synthetic"]}, workers={}, ready_models=[])
    try:
        started = time.monotonic()
        with pytest.raises(JobsNotFinished, match=r"1 job\(s\) of synthetic .* not finished "
                                                  r"2s after their submit, e.g. \S+ \(queued\)"):
            run_load(stack.api, "synthetic", 1, 1, duration=0.5, warmup=0, job_timeout=2)
        # Not the 30 s a `Prefer: wait=30` would have held the request for.
        assert time.monotonic() - started < 25
    finally:
        stack.stop()


def test_threads_benchmark_times_both_counts_in_both_conditions(tmp_path):
    # --seconds 0: each cell timed once, as the benchmark times each at least once.
    out = subprocess.run([sys.executable, "-m", "bench.threads", "--seconds", "0",
                          "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "threads.json").read_text())
    assert report["threads"] == {"cores less one": max(1, report["usable_cpus"] - 1),
                                 "torch default": report["usable_cpus"]}
    cells = {(r["condition"], r["config"], r["batch_size"]) for r in report["rows"]}
    assert cells == {(c, n, s) for c in ("idle", "busy") for n in report["threads"]
                     for s in (1, 16, 32)}
    assert all(r["calls"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0 for r in report["rows"])
    assert (tmp_path / "threads.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_backlog_is_drained_in_full_batches_and_timed_from_its_records():
    out = subprocess.run([sys.executable, "-m", "bench.drain", "--jobs", "96", "--rounds", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    [drained] = report["rounds"]["this"]
    # Every queued job ran once, in batches the backlog filled (32 at most, the synthetic
    # model's max_batch_size), each a model call of 20 ms and more.
    assert drained["jobs"] == drained["runs"] == 96, drained
    assert 3 <= drained["batches"] <= 12 and drained["mean_batch"] >= 8, drained
    assert drained["model_ms_per_batch"] >= 20 and drained["cycle_ms_mean"] >= 20, drained
    assert 0 < drained["ratio"] < 1.2 and 0 < drained["model_busy"] <= 1, drained
    assert report["ceiling_items_per_s"] == pytest.approx(32 / 26.4 * 1000, rel=0.01)
