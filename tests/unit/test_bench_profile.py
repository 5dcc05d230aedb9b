"""bench.profile shares a process's measured CPU out by its py-spy samples."""
from pathlib import Path

from bench import profile

RULES = [("submit", r"JobStore\.submit "), ("read", r"JobStore\.get "),
         ("server", r"\(gunicorn/"), ("loop", r"\(selectors\.py")]


def _raw(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "api.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_costs_share_the_measured_cpu_by_the_samples_and_skip_waiting_threads(tmp_path):
    raw = _raw(tmp_path, [
        'process 1:"MainThread";run (gunicorn/arbiter.py:1);JobStore.submit (app/store.py:9);'
        'execute (redis/client.py:3) 30',
        'process 1:"MainThread";run (gunicorn/arbiter.py:1);JobStore.get (app/store.py:12) 10',
        'process 1:"MainThread";run (gunicorn/arbiter.py:1);handle (gunicorn/sync.py:4) 10',
        # A pool thread blocked in its queue: waiting, not CPU; left out of the shares.
        'process 1:"ThreadPool-1";_bootstrap (threading.py:1);_worker '
        '(concurrent/futures/thread.py:81) 50',
    ])
    costs = dict(profile.costs(raw, 2.5, RULES))
    # 50 samples that count: 30 submit, 10 read, 10 server alone, of 2.5 ms a job.
    assert costs == {"submit": 1.5, "read": 0.5, "server": 0.5}


def test_top_names_functions_by_total_and_self(tmp_path):
    raw = _raw(tmp_path, [
        'process 1:"MainThread";a (app/x.py:1);b (tasks/y.py:2) 3',
        'process 1:"MainThread";a (app/x.py:1) 1',
    ])
    top = profile.top(raw, 4.0)
    assert top["samples"] == 4
    assert dict(top["self"]) == {"b (tasks/y.py)": 3.0, "a (app/x.py)": 1.0}
    assert dict(top["project"]) == {"a (app/x.py)": 4.0, "b (tasks/y.py)": 3.0}
