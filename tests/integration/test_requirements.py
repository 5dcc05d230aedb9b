"""requirements/api.txt is all an API host installs (the API's container image installs it
alone): the API under gunicorn, Flower and `celery -A tasks.cli` start and serve with the
modules it provides and nothing else, torch, transformers and matplotlib above all."""
from __future__ import annotations

import os
import re
import subprocess

import requests

from scripts.stack import ROOT, VENV_BIN, start_flower, start_web
from tests.support.requirements import REQUIREMENTS, guard_env

API_ONLY = REQUIREMENTS / "api.txt"


def refused(log: str) -> set[str]:
    return set(re.findall(r"^import guard: refused (\S+)$", log, re.M))


def test_the_api_flower_and_the_celery_cli_run_on_the_api_requirements_alone(redis_server,
                                                                              tmp_path):
    base = {k: v for k, v in os.environ.items() if not k.startswith("IQ_")}
    env = guard_env(dict(base, REDIS_URL=redis_server.extra["url"], PYTHONUNBUFFERED="1"),
                    API_ONLY, tmp_path)
    web = start_web(env, tmp_path)
    try:
        api = web.extra["url"]
        job = requests.post(f"{api}/v1/jobs", json={"model": "minilm-embed", "inputs": ["hi"]},
                            timeout=10)
        assert job.status_code == 202, job.text  # validated, recorded and queued
        assert requests.get(f"{api}/v1/jobs/{job.json()['id']}", timeout=10).json()[
            "status"] == "queued"
        assert requests.get(f"{api}/openapi.json", timeout=10).ok
        assert "iq_jobs_submitted_total" in requests.get(f"{api}/metrics", timeout=10).text
    finally:
        web.stop()
    flower = start_flower(env, tmp_path, "admin:pw")
    flower.stop()
    cli = subprocess.run([str(VENV_BIN / "celery"), "-A", "tasks.cli", "report"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr[-3000:]
    logs = web.log.read_text() + flower.log.read_text() + cli.stderr
    assert logs.count("import guard: on") == 3  # the API, Flower, the cli: all guarded
    assert not refused(logs) & {"torch", "transformers", "matplotlib", "app", "tasks",
                                "config"}, refused(logs)
