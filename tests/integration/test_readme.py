"""README.md's five-minute curl session and its Python client in ten lines, run as written on
a fresh `make run` (the shipped models file, real MiniLM), and docs/getting-started.md's Python
session after them. Every port is a free one and the var directory the test's own
(test_make_run.run_env); the blocks find the API through IQ_PORT, as a reader's shell does."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from scripts.stack import ROOT
from tests.integration.test_make_run import MakeRun, run_env

pytestmark = pytest.mark.slow


def blocks(path, section: str, lang: str) -> list[str]:
    text = (ROOT / path).read_text()
    body = re.split(rf"^## {re.escape(section)}$", text, flags=re.M)[1]
    body = re.split(r"^## ", body, flags=re.M)[0]
    return re.findall(rf"^```{lang}\n(.*?)^```", body, re.S | re.M)


@pytest.fixture(scope="module")
def make_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readme")
    env = run_env(tmp)
    run = MakeRun(env, tmp / "make-run.log")
    try:
        run.wait_up(240)  # MiniLM loads in the worker's child first
        yield {k: v for k, v in env.items() if k not in ("IQ_API_URL", "IQ_API_KEY")}
    finally:
        run.stop(signal.SIGINT)
        run.reap()


def test_the_curl_session_runs_as_written(make_run):
    [session] = blocks("README.md", "A five-minute curl session", "sh")
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + session], cwd=ROOT,
                          env=make_run, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr}"
    out = done.stdout
    answers = [line for line in out.splitlines() if line.startswith("{")]
    assert '"status":"succeeded"' in answers[0] and '"batch":' in answers[0]
    [queued] = [line for line in done.stderr.splitlines() if line.startswith("{")]  # via tee
    for field in ('"status":"queued"', '"url":', '"created_at":', '"started_at":null',
                  '"finished_at":null', '"trace_id":', '"encoding_format":"float"',
                  '"progress":{"items_done":0,"items":1}'):
        assert field in queued, (field, queued)
    assert '"label":"sports"' in answers[1]
    assert '"inputs":["Length must be between 1 and 64."]' in answers[2]
    assert "id: progress-32" in out and "id: succeeded" in out  # two model calls of 32
    assert '"status":"expired"' in answers[3] and '"code":"expired"' in answers[3]
    assert '"status":"expired"' in answers[4] and '"retry_of":' in answers[5]
    assert out.rstrip().endswith("204")


def test_the_python_client_runs_as_written(make_run):
    [ten_lines] = blocks("README.md", "The Python client in ten lines", "python")
    [session] = [b for b in blocks("docs/getting-started.md", "A curl session", "python")]
    env = dict(make_run, IQ_API_URL=f"http://127.0.0.1:{make_run['IQ_PORT']}",
               PYTHONPATH=str(ROOT / "client"))
    for code in (ten_lines, session):
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, f"{code}\n{done.stderr}"
        if code is ten_lines:
            assert done.stdout.splitlines()[0] == "2 384"
            assert "'label': 'sports'" in done.stdout
            assert "{'inputs': ['Length must be between 1 and 64.']}" in done.stdout
        else:
            assert "progress {'items_done': 32, 'items': 64}" in done.stdout
