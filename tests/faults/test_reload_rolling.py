"""Issue 29: a models reload rolls through the workers that serve a queue
(workers/batching/turns.py). Two workers of one pool child each on one queue, default settings,
under load: one worker's new child loads the new models beside its old one (a surge:
workers/batching/reload.py) while both keep serving the queue with the old version; only once that
new child is up (and the first's old one gone) does the other worker start its own, and the first
serves with the new version meanwhile. Every job succeeds and runs once, none is lost, and the
reload ends with both workers on the new version.

Each worker reads its own copy of the models file (the same bytes: the reload checks its
revision), so that the synthetic model's relative `load_gate` is a file of its own per worker:
the test holds each worker's new child loading for as long as it needs, so that "while the
other loads" is a fact, not a race."""
from __future__ import annotations

import collections
import re
import subprocess
import sys

import pytest
import requests
import yaml

from scripts.stack import ROOT, launch, start_worker, wait_until
from tests.support.load import Load, runs
from tests.support.records import fields, fields_of

pytestmark = pytest.mark.slow

MODEL = {"kind": "synthetic", "base_ms": 50, "per_item_ms": 0, "max_batch_size": 4,
         "runs_log": "runs.log", "load_gate": "load-gate"}
OLD, NEW = {**MODEL, "version": "v1"}, {**MODEL, "version": "v2"}
WORKERS = ("a", "b")


def models_text(spec: dict) -> str:
    return yaml.safe_dump({"models": {"rolled": spec}})


def log_of(stack, node: str) -> str:
    return stack.workers[node].log.read_text(errors="replace")


def began(stack, node: str) -> bool:
    """Whether worker `node` started its new child (beside its old one)."""
    return "surge child loads" in log_of(stack, node)


def ready_lines(stack, node: str) -> int:
    """How many times worker `node`'s children said the model was loaded."""
    return log_of(stack, node).count(" ready on ")


def probe(stack, tag: str, count: int = 6) -> list[tuple[str, str]]:
    """`count` jobs sent now, each waited for: (the worker node that ran it, its version)."""
    ids = [stack.submit("rolled", [f"{tag}-{i}"])["id"] for i in range(count)]
    bodies = [stack.finished(job_id, timeout=60) for job_id in ids]
    assert {b["status"] for b in bodies} == {"succeeded"}, bodies
    return [(fields(stack.redis, b["id"])["worker"].split("@")[0], b["model_version"])
            for b in bodies]


@pytest.fixture
def stack(tmp_path):
    stack = launch(tmp_path, {"rolled": OLD}, {}, defaults=True, ready_models=[])
    try:
        for node in WORKERS:
            (tmp_path / node).mkdir()
            own = tmp_path / node / "models.yaml"  # its own folder: its own gate and runs log
            own.write_text(models_text(OLD))
            stack.workers[node] = start_worker(node, dict(stack.env, IQ_MODELS_FILE=str(own)),
                                               tmp_path, ["rolled"])
        wait_until(lambda: all(ready_lines(stack, n) for n in WORKERS), 180,
                   "both workers' children loaded")
        stack.wait_live(["rolled"], 60)
        yield stack
    finally:
        for node in WORKERS:
            (tmp_path / node / "load-gate").unlink(missing_ok=True)
        stack.stop()


def start_reload(stack) -> subprocess.Popen:
    """`make reload FILE=…` of the new file, each worker's copy written first (a worker takes
    the file only once the reload announces its revision)."""
    new = stack.workdir / "new.yaml"
    new.write_text(models_text(NEW))
    for node in WORKERS:
        (stack.workdir / node / "models.yaml").write_text(models_text(NEW))
    return subprocess.Popen([sys.executable, "-m", "scripts.reload", str(new), "--timeout",
                             "120"], cwd=ROOT, env=stack.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def stamp(log: str, pattern: str) -> str:
    """The time stamp of the first line of a worker's log matching `pattern`."""
    line = next(ln for ln in log.splitlines() if re.search(pattern, ln))
    return re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}", line).group(0)


def test_two_workers_on_a_queue_reload_in_turn_and_the_queue_is_always_served(stack):
    gates = {node: stack.workdir / node / "load-gate" for node in WORKERS}
    for gate in gates.values():
        gate.touch()  # from now on a child loading the model waits, each worker's on its own
    load = Load(stack.api, "rolled", "load", clients=4, pause_s=0.1).start()
    reload = start_reload(stack)
    try:
        first = wait_until(lambda: next((n for n in WORKERS if began(stack, n)), None), 60,
                           "a worker to start its new child")
        other = "b" if first == "a" else "a"
        loaded = {n: ready_lines(stack, n) for n in WORKERS}
        # first's new child loads; both serve the queue with the old version meanwhile.
        assert {v for _n, v in probe(stack, "while-first-loads")} == {"v1"}
        assert not began(stack, other) and ready_lines(stack, first) == loaded[first]

        gates[first].unlink()  # first's new child comes up; then, only then, other's turn
        wait_until(lambda: began(stack, other), 60, f"{other} to start its new child")
        assert ready_lines(stack, first) == loaded[first] + 1
        assert "stops after its batch" in log_of(stack, first), "first's old child went"
        assert set(probe(stack, "while-other-loads")) <= {(first, "v2"), (other, "v1")}
        assert ready_lines(stack, other) == loaded[other], "other's new child still loads"

        gates[other].unlink()
        out, _ = reload.communicate(timeout=180)
        assert reload.returncode == 0 and "reload done" in out, out
        logs = {n: log_of(stack, n) for n in WORKERS}
        assert stamp(logs[first], r"version v2 ready on") <= \
            stamp(logs[other], "surge child loads"), "the new children came up in turn"
        assert "its turn after worker:" in out, out
    finally:
        for gate in gates.values():
            gate.unlink(missing_ok=True)
        if reload.poll() is None:
            reload.kill()
        load.stop()
    check_every_job(stack, load)


def check_every_job(stack, load: Load) -> None:
    """Every job the load sent succeeded, on either worker and version, and ran once; after
    the reload both workers serve the new version."""
    assert load.gave_up == [] and len(load.accepted) > 20
    for job_id in load.accepted.values():
        stack.finished(job_id, timeout=60)
    records = fields_of(stack.redis, list(load.accepted.values()))
    assert {r["status"] for r in records.values()} == {"succeeded"}
    split = collections.Counter((r["worker"].split("@")[0], r["model_version"])
                                for r in records.values())
    print(f"\nrolling reload under load: {len(records)} jobs, all succeeded once; by worker "
          f"and version: {dict(sorted(split.items()))}")
    ran_on = set(split)
    assert ran_on <= {(n, v) for n in WORKERS for v in ("v1", "v2")}
    assert {v for _n, v in ran_on} == {"v1", "v2"}, "the load ran through the reload"
    ran = runs(stack.workdir / "a" / "runs.log") + runs(stack.workdir / "b" / "runs.log")
    assert {text: ran[text] for text in load.accepted} == {text: 1 for text in load.accepted}
    body = requests.get(f"{stack.api}/v1/models", timeout=10).json()
    (model,) = body["models"]
    assert [v["version"] for v in model["versions"]] == ["v2"]
    after = probe(stack, "after")
    assert {v for _n, v in after} == {"v2"}
