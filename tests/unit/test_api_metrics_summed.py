"""/metrics of the API in prometheus_client's multiprocess mode (gunicorn.conf.py sets its
folder for every start): every family is exported as with one process, those nothing has
counted in yet included."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scripts.processes import ROOT

_SCRAPE = """
from app.metrics import ApiMetrics
m = ApiMetrics(lambda: {"a": 3}, lambda: 0, 5, lambda: (0, 0))
m.submitted.labels("a").inc()
print(m.render().get_data(as_text=True))
"""


def test_families_nothing_counted_in_yet_are_exported_with_the_summed_ones(tmp_path):
    text = subprocess.run([sys.executable, "-c", _SCRAPE], cwd=ROOT, check=True,
                          capture_output=True, text=True,
                          env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
                               "PYTHONPATH": str(ROOT)}).stdout
    types = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert {"iq_jobs_submitted_total", "iq_jobs_rejected_total", "iq_http_requests_total",
            "iq_http_request_duration_seconds", "iq_queue_depth"} <= types
    assert 'iq_jobs_submitted_total{model="a"} 1.0' in text
    assert 'iq_queue_depth{model="a"} 3.0' in text
    assert len([line for line in text.splitlines()
                if line.startswith("# TYPE iq_jobs_submitted_total ")]) == 1


def test_each_label_set_is_looked_up_once_and_every_count_lands():
    from app.metrics import ApiMetrics

    m = ApiMetrics(lambda: {}, lambda: 0, 5, lambda: (0, 0))
    asked: list = []
    for metric in (m.requests, m.submitted):
        real = metric.labels
        metric.labels = lambda *values, _real=real: asked.append(values) or _real(*values)
    for _ in range(3):
        m.submitted_job("a")
        m._counted("/v1/jobs", "POST", 202).inc()
    m.submitted_job("b")
    assert asked == [("a",), ("/v1/jobs", "POST", "202"), ("b",)]
    text = m.render().get_data(as_text=True)
    assert 'iq_jobs_submitted_total{model="a"} 3.0' in text
    assert 'iq_jobs_submitted_total{model="b"} 1.0' in text
    assert 'iq_http_requests_total{method="POST",route="/v1/jobs",status="202"} 3.0' in text


_FORKED = """
import os, sys
from app.metrics import ApiMetrics
calls = []
sys.setprofile(lambda frame, event, arg: calls.append(arg) if event == "c_call"
               and getattr(arg, "__name__", "") == "getpid" else None)
m = ApiMetrics(lambda: {}, lambda: 0, 5, lambda: (0, 0))
for _ in range(5):
    m.submitted_job("a")
    m._counted("/v1/jobs", "POST", 202).inc()
    m._timed("/v1/jobs", "POST").observe(0.01)
sys.setprofile(None)
print(len(calls))
child = os.fork()
if child == 0:
    m.submitted_job("a")  # the child's own file, as with os.getpid
    os._exit(0)
os.waitpid(child, 0)
print(sorted(name.split("_")[-1] == f"{child}.db" for name in os.listdir(sys.argv[1])))
print(m.render().get_data(as_text=True))
"""


def test_a_count_asks_the_kernel_for_no_pid_and_a_fork_counts_in_its_own_file(tmp_path):
    """prometheus_client's check for a fork at each write is given the pid kept in the
    process (config/process.py), not os.getpid's system call: no getpid for 15 writes. A
    forked child still writes its own file, and the counts are summed as before."""
    lines = subprocess.run([sys.executable, "-c", _FORKED, str(tmp_path)], cwd=ROOT,
                           check=True, capture_output=True, text=True,
                           env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
                                "PYTHONPATH": str(ROOT)}).stdout.splitlines()
    assert lines[0] == "0"
    assert lines[1] == "[False, False, True, True]"  # counter and histogram files: each process its own
    text = "\n".join(lines[2:])
    assert 'iq_jobs_submitted_total{model="a"} 6.0' in text
    assert 'iq_http_requests_total{method="POST",route="/v1/jobs",status="202"} 5.0' in text
    assert 'iq_http_request_duration_seconds_count{method="POST",route="/v1/jobs"} 5.0' in text


_PATCHED = """
import os, runpy, sys
if sys.argv[1] == "conf":
    runpy.run_path("gunicorn.conf.py")  # what gunicorn's master reads before it forks
from gevent import monkey
monkey.patch_all()  # what the gevent worker does in each process, then it imports the app
from app.metrics import ApiMetrics
m = ApiMetrics(lambda: {}, lambda: 0, 5, lambda: (0, 0))
child = m._counted("/v1/jobs", "POST", 202)
child.inc()
calls = []
sys.setprofile(lambda frame, event, arg: calls.append(1) if event == "call"
               and "gevent" in frame.f_code.co_filename else None)
for _ in range(10):
    child.inc()
sys.setprofile(None)
print(len(calls))
"""


@pytest.mark.parametrize("master, gevent_calls", [("conf", 0), ("none", 10)])
def test_a_count_takes_the_interpreters_lock_not_geventss(tmp_path, master, gevent_calls):
    """gunicorn.conf.py imports prometheus_client's values module in the master, before the
    gevent worker patches `threading`: the counters' lock is the interpreter's, not gevent's
    Python lock (one call into gevent a write, imported after the patch)."""
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "TMPDIR": str(tmp_path),
           "PYTHONPATH": str(ROOT), "PATH": os.environ["PATH"]}
    if master == "conf":
        del env["PROMETHEUS_MULTIPROC_DIR"]  # gunicorn.conf.py makes its own, under TMPDIR
    out = subprocess.run([sys.executable, "-c", _PATCHED, master], cwd=ROOT, check=True,
                         capture_output=True, text=True, env=env).stdout
    assert out.split() == [str(gevent_calls)]
