"""A reload that changes a model's `queue:`, on the default settings, under load (several jobs a
second across it), counting how many times each job ran: what waits on the old queue (its
three priority lists, and what the worker hands back from its buffer when it stops consuming
it) is moved to the new one once no worker consumes the old (tasks/queuemoves.py); every
accepted job ends `succeeded`, having run once; a rename while no worker runs is refused,
nothing changed. Before, 181 of 675 jobs stayed `queued` with 0 runs:
the worker stopped consuming the old queue, the jobs it had buffered went back onto it, the
reconciler left them there (they were on a queue) and `iq_queue_depth` read 0. Two reloads
started at once: one runs, the other is refused with nothing changed, and runs afterwards."""
from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
import requests
import yaml

from scripts.stack import ROOT, launch, start_worker, wait_until
from tasks.names import queue_lists
from tests.support.load import Load
from tests.support.outcomes import assert_each_succeeded_once, settle

pytestmark = pytest.mark.slow

ALPHA = {"kind": "synthetic", "base_ms": 30, "per_item_ms": 1, "max_batch_size": 8}
BETA = {"kind": "synthetic", "base_ms": 30, "per_item_ms": 1, "max_batch_size": 8}
MODELS = {"alpha": ALPHA, "beta": BETA}


@pytest.fixture
def stack(tmp_path):
    # One worker consuming every model's queue (no -Q), one child: the defaults.
    stack = launch(tmp_path, MODELS, {"all": None}, defaults=True)
    try:
        yield stack
    finally:
        stack.stop()


def reload_process(stack, models: dict, timeout: int = 240) -> subprocess.Popen:
    path = stack.workdir / f"new-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump({"models": models}))
    return subprocess.Popen([sys.executable, "-m", "scripts.reload", str(path), "--timeout",
                             str(timeout)], cwd=ROOT, env=stack.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def reload(stack, models: dict, timeout: int = 240) -> tuple[int, str]:
    proc = reload_process(stack, models, timeout)
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def depth(stack, model: str) -> float:
    """iq_queue_depth of `model`, as /metrics exports it."""
    text = requests.get(f"{stack.api}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("iq_queue_depth{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no iq_queue_depth for {model}")


def waiting(stack, queue: str) -> int:
    return sum(stack.redis.llen(name) for name in queue_lists(queue))


def test_a_queue_renamed_under_load_strands_no_job(stack):
    load = Load(stack.api, "alpha", "rename", clients=4, pause_s=0.05).start()
    try:
        wait_until(lambda: len(load.accepted) >= 40, 60, "the load to run")
        status, out = reload(stack, {"alpha": {**ALPHA, "queue": "alpha-q2"}, "beta": BETA})
        assert status == 0, out
        assert "reload done" in out
        after = len(load.accepted)
        wait_until(lambda: len(load.accepted) >= after + 40, 60, "jobs after the reload")
    finally:
        load.stop()
    jobs = list(load.accepted.values())
    records = settle(stack, jobs)
    print(f"\nqueue renamed under load: {len(jobs)} jobs accepted, "
          f"{sum(r.get('status') == 'succeeded' for r in records.values())} succeeded, "
          f"{waiting(stack, 'alpha')} left on the old queue")
    assert_each_succeeded_once(records)
    assert waiting(stack, "alpha") == 0 and waiting(stack, "alpha-q2") == 0
    assert load.gave_up == []


def test_a_rename_while_no_worker_runs_is_refused_and_strands_no_job(stack):
    """Nothing consumes while the jobs wait: the rename is refused once its wait for a
    worker is out, nothing changed (it was once installed with no worker to ask, and its
    jobs moved to a queue no running process had taken up). (What waits on a renamed queue
    moves, counted: tests/integration/test_queue_moves.py; under load: above.)"""
    stack.workers["all"].stop()
    jobs = [stack.submit("alpha", [f"a{i}"], priority=("high", "normal", "low")[i % 3])["id"]
            for i in range(9)]
    before = (stack.workdir / "models.yaml").read_bytes()
    status, out = reload(stack, {"alpha": {**ALPHA, "queue": "alpha-q2"}, "beta": BETA},
                         timeout=5)
    assert status == 1, out
    assert "reload refused, nothing changed: no worker reports on REDIS_URL's Redis after " \
        "5s" in out, out
    assert (stack.workdir / "models.yaml").read_bytes() == before
    assert [stack.redis.llen(name) for name in queue_lists("alpha")] == [3, 3, 3]
    cancel = requests.post(f"{stack.api}/v1/jobs/{jobs[0]}/cancel", timeout=10)
    assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled", cancel.text

    # The worker started again (on the file in place) serves them; once it does, the rename
    # goes through. None stays queued, each ran once, the cancelled one never ran.
    stack.workers["all"] = start_worker("all", stack.env, stack.workdir, None)
    stack.wait_live(["alpha", "beta"], 180)
    status, out = reload(stack, {"alpha": {**ALPHA, "queue": "alpha-q2"}, "beta": BETA})
    assert status == 0, out
    records = settle(stack, jobs)
    assert records[jobs[0]]["status"] == "cancelled" and not records[jobs[0]].get("runs")
    assert_each_succeeded_once({j: records[j] for j in jobs[1:]})
    assert depth(stack, "alpha") == 0


def test_two_reloads_at_once_one_waits_for_the_other_and_no_job_is_stranded(stack):
    loads = [Load(stack.api, m, f"race-{m}", clients=2, pause_s=0.05).start()
             for m in ("alpha", "beta")]
    try:
        wait_until(lambda: all(len(x.accepted) >= 20 for x in loads), 60, "the load to run")
        first = reload_process(stack, {"alpha": {**ALPHA, "queue": "alpha-q2"}, "beta": BETA})
        second = reload_process(stack, {"alpha": ALPHA, "beta": {**BETA, "queue": "beta-q2"}})
        outs = [p.communicate(timeout=300)[0] for p in (first, second)]
        codes = sorted(p.returncode for p in (first, second))
        assert codes == [0, 1], outs
        refused = outs[[first.returncode, second.returncode].index(1)]
        assert "another reload" in refused and "nothing changed" in refused, refused
        # The refused one changed nothing: the file is the other's; run it again, after.
        if first.returncode == 1:
            status, out = reload(stack, {"alpha": {**ALPHA, "queue": "alpha-q2"},
                                         "beta": BETA})
        else:
            status, out = reload(stack, {"alpha": ALPHA, "beta": {**BETA, "queue": "beta-q2"}})
        assert status == 0, out
        counts = [len(x.accepted) for x in loads]
        wait_until(lambda: all(len(x.accepted) >= n + 20 for x, n in zip(loads, counts)), 60,
                   "jobs after the reloads")
    finally:
        for x in loads:
            x.stop()
    jobs = [j for x in loads for j in x.accepted.values()]
    records = settle(stack, jobs)
    assert_each_succeeded_once(records)
    for queue in ("alpha", "beta", "alpha-q2", "beta-q2"):
        assert waiting(stack, queue) == 0, queue
