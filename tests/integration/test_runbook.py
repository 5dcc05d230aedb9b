"""docs/troubleshooting.md is run, block by block, so that none of its commands rots.

Every `sh` block runs in bash (`set -euo pipefail`) after the page's setup block, against a
real stack: Redis with a password read from a secrets folder as `make run` keeps it, a prefork
worker, gunicorn. The setup block is given the variables `make run` users set (ports, var
folder, worker name), never the derived ones it computes. The models are synthetic stand-ins
under the shipped names, so the commands run as written. A block must exit 0 and print
something. Blocks marked GPU only are syntax-checked, and skipped without `nvidia-smi`.
Every metric the page names must be exported."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass

import pytest
import redis
import requests

from tests.support.metrics import exported, named_in
from scripts.stack import ROOT, launch

RUNBOOK = ROOT / "docs" / "troubleshooting.md"
_BLOCK = re.compile(r"(?:<!-- runbook: (?P<mark>\w+) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)^```",
                    re.S | re.M)


@dataclass(frozen=True)
class Block:
    mark: str | None
    lang: str
    code: str
    name: str  # the section and line, for the test's id


def blocks() -> list[Block]:
    text = RUNBOOK.read_text()
    found = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code"))
        section = re.findall(r"^## (.+)$", text[:m.start()], re.M)[-1]
        slug = re.sub(r"[^a-z]+", "-", section.lower()).strip("-")
        found.append(Block(m["mark"], m["lang"], m["code"], f"{slug}-L{line}"))
    return found


BLOCKS = blocks()
SETUP = next(b for b in BLOCKS if b.mark == "setup")
COMMANDS = [b for b in BLOCKS if b.lang == "sh" and b is not SETUP]


def test_every_block_is_a_command_or_a_query():
    assert {b.lang for b in BLOCKS} <= {"sh", "promql"}, "a block the check would not run"
    assert {b.mark for b in BLOCKS} <= {None, "setup", "gpu"}
    assert len(COMMANDS) >= 12


@pytest.fixture(scope="module")
def runbook_env(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("runbook")
    worker = f"rb{uuid.uuid4().hex[:8]}"
    models = {"minilm-embed": {"kind": "synthetic", "base_ms": 20, "per_item_ms": 1},
              "orphan": {"kind": "synthetic"}}  # served by no worker: its jobs stay queued
    stack = launch(workdir, models, {worker: ["minilm-embed"]}, ready_models=["minilm-embed"])
    try:
        done = stack.finished(stack.submit("minilm-embed", ["a", "bb"])["id"])
        stack.submit("orphan", ["stuck"])
        secrets = workdir / "var" / "secrets"
        secrets.mkdir(parents=True)
        (secrets / "redis-password").write_text(stack.redis_svc.extra["password"] + "\n")
        (secrets / "redis-app-password").write_text(stack.redis_svc.extra["app_password"] + "\n")
        metrics_url = stack.workers[worker].extra["metrics_url"]
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("IQ_", "REDIS")) and k != "PROMETHEUS_MULTIPROC_DIR"}
        yield stack, dict(
            base, HF_HUB_OFFLINE="1", JOB=done["id"], IQ_VAR_DIR=str(workdir / "var"),
            IQ_PORT=str(stack.web.extra["port"]), REDIS_PORT=str(stack.redis_svc.extra["port"]),
            IQ_WORKER_METRICS_PORT=metrics_url.split(":")[-1].split("/")[0],
            IQ_WORKER_NAME=worker, IQ_MODELS_FILE=str(workdir / "models.yaml"))
    finally:
        stack.stop()


def bash(script: str, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *flags, "-c", "set -euo pipefail\n" + script], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("block", COMMANDS, ids=[b.name for b in COMMANDS])
def test_runbook_command(block, runbook_env):
    _, env = runbook_env
    script = SETUP.code + block.code
    checked = bash(script, env, "-n")
    assert checked.returncode == 0, checked.stderr
    if block.mark == "gpu" and shutil.which("nvidia-smi") is None:
        pytest.skip("GPU only: syntax checked; no nvidia-smi on this host")
    ran = bash(script, env)
    assert ran.returncode == 0, f"{block.code}\nexit {ran.returncode}\n{ran.stderr}"
    assert ran.stdout.strip(), f"{block.code}\nprinted nothing\n{ran.stderr}"


def test_setup_finds_the_stack(runbook_env):
    stack, env = runbook_env
    shown = bash(SETUP.code + 'echo "$IQ_API_URL $MAIN"; rcli PING; api /healthz', env)
    assert shown.returncode == 0, shown.stderr
    url, main = shown.stdout.splitlines()[0].split()
    assert url == stack.api and int(main) == next(iter(stack.workers.values())).proc.pid
    assert "PONG" in shown.stdout and '"ok"' in shown.stdout


def test_setup_gives_celery_the_application_user(runbook_env):
    """`celery -A tasks.cli` gets the application's user, as every process of the stack does,
    not the admin, whom no application gets (docs/security.md)."""
    _, env = runbook_env
    shown = bash(SETUP.code + 'echo "$REDIS_URL"', env)
    assert shown.returncode == 0, shown.stderr
    client = redis.Redis.from_url(shown.stdout.strip(), decode_responses=True)
    assert client.ping()
    with pytest.raises(redis.exceptions.NoPermissionError):  # the admin's would be allowed
        client.config_get("maxmemory")


def test_every_metric_the_runbook_names_is_exported(runbook_env):
    stack, env = runbook_env
    named = named_in("\n".join(b.code for b in BLOCKS))
    worker_metrics = f"http://127.0.0.1:{env['IQ_WORKER_METRICS_PORT']}/metrics"
    assert requests.get(worker_metrics, timeout=5).ok
    missing = named - exported(f"{stack.api}/metrics", worker_metrics)
    assert not missing, f"the runbook names metrics nobody exports: {missing}"
    assert len(named) >= 8
