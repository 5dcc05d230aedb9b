"""Workers on hosts of their own, started as README's "More hosts" says
(`REDIS_URL=… scripts/worker.sh`), on the default settings: each host is a network namespace
joined to Redis's by a veth pair (scripts/hosts.py). Node names and metrics ports never
collide by default; a host cut off for longer than the visibility timeout leaves its jobs to
the other host within 60 s, only the batch it was running runs twice, and once healed it
rejoins by itself. Latency (tc netem) is added where the kernel has netem."""
from __future__ import annotations

import collections
import re
import threading
import time
import uuid

import pytest
import requests
import yaml

from config import load_settings
from scripts import hosts as nethosts
from scripts.stack import ROOT, launch, spawn, wait_until
from tasks.keys import CONSUMING_KEY
from tests.support.records import fields, fields_of
from tests.support.tools import require

pytestmark = pytest.mark.slow

WHY = nethosts.unavailable()
NETEM_WHY = WHY or nethosts.netem_unavailable()
BATCH = 4
MODEL = {"kind": "synthetic", "base_ms": 250, "per_item_ms": 0, "max_batch_size": BATCH,
         "max_inputs": 1}
RECOVERY_S = 60


def _host_models(workdir, name: str) -> str:
    """The host's own copy of the models file: the same model, logging each input it runs to
    a file of the host's, so that the test counts where each job ran and how often."""
    path = workdir / f"models-{name}.yaml"
    path.write_text(yaml.safe_dump({"models": {"work": {**MODEL,
                                                        "runs_log": str(workdir / f"{name}.runs")}}}))
    return str(path)


def _runs(workdir, name: str) -> list[str]:
    try:
        return (workdir / f"{name}.runs").read_text().split()
    except FileNotFoundError:
        return []


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    require("iptables")
    if WHY:
        pytest.skip(WHY)
    workdir = tmp_path_factory.mktemp("hosts")
    with nethosts.hosts(2) as hosts:
        stack = launch(workdir, {"work": MODEL}, {}, defaults=True, ready_models=[],
                       bind=[h.gateway for h in hosts])
        try:
            port = stack.redis_svc.extra["port"]
            password = stack.redis_svc.extra["app_password"]
            for host in hosts:
                # README's "More hosts" recipe, on the host: no node name, no metrics port.
                env = {k: v for k, v in stack.env.items() if k != "IQ_MODELS_FILE"}
                env.update(REDIS_URL=f"redis://iq:{password}@{host.gateway}:{port}/0",
                           IQ_MODELS_FILE=_host_models(workdir, host.name))
                stack.workers[host.name] = spawn(f"worker-{host.name}",
                                                 host.command(["scripts/worker.sh"]), env,
                                                 workdir)
            wait_until(lambda: len(_consuming(stack)) == 2, 180, "a worker on each host")
            yield stack, hosts
        finally:
            stack.stop()


def _consuming(stack) -> list[str]:
    ttl = load_settings(environ={}).heartbeat_ttl_s
    return stack.redis.zrangebyscore(CONSUMING_KEY, time.time() - ttl, "+inf")


def test_workers_started_by_the_recipe_have_names_of_their_own(two_hosts):
    stack, hosts = two_hosts
    names = sorted(_consuming(stack))
    assert [n.split("@")[1] for n in names] == sorted(h.name for h in hosts)
    assert all(re.fullmatch(r"worker-\d+@\S+", n) for n in names), names
    for host in hosts:
        assert "worker metrics on 127.0.0.1:9808/metrics" in stack.workers[host.name].tail(400)


def test_two_workers_on_one_host_get_their_own_name_and_metrics_port(tmp_path):
    """The recipe run twice on one host: no IQ_WORKER_NAME, the default metrics port."""
    stack = launch(tmp_path, {"work": MODEL}, {}, defaults=True, ready_models=[])
    try:
        env = {k: v for k, v in stack.env.items() if k != "IQ_WORKER_METRICS_PORT"}
        for i in range(2):
            stack.workers[f"w{i}"] = spawn(f"w{i}", ["scripts/worker.sh"], env, tmp_path)
        wait_until(lambda: len(_consuming(stack)) == 2, 180, "both workers consuming")
        found = [re.search(r"worker metrics on 127\.0\.0\.1:(\d+)/metrics",
                           stack.workers[f"w{i}"].tail(400)) for i in range(2)]
        ports = {int(m.group(1)) for m in found if m}
        assert len(ports) == 2, [stack.workers[f"w{i}"].tail(40) for i in range(2)]
        for port in ports:  # each serves its own (empty until a job ran)
            answer = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
            assert answer.ok and answer.headers["content-type"].startswith("text/plain")
    finally:
        stack.stop()


class Feed:
    """One-input jobs with unique tokens, submitted at a steady rate until stopped."""

    def __init__(self, stack, per_s: float = 8) -> None:
        self.stack, self.pause = stack, 1 / per_s
        self.jobs: list[tuple[float, str, str]] = []  # (submitted at, token, job id)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.pause) and len(self.jobs) < 3000:
            token = uuid.uuid4().hex
            job = self.stack.submit("work", [token])
            self.jobs.append((time.time(), token, job["id"]))

    def since(self, moment: float) -> list[tuple[float, str, str]]:
        return [j for j in self.jobs if j[0] > moment]


def _finished_at(record: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(record["finished_at"]).timestamp()


def test_a_host_cut_off_past_the_visibility_timeout_loses_nothing_and_rejoins(two_hosts):
    stack, (cut, other) = two_hosts
    settings = load_settings(environ={})
    cut_s = max(45, settings.visibility_timeout_s + 15)
    feed = Feed(stack)
    try:
        start = len(_runs(stack.workdir, cut.name))
        wait_until(lambda: len(_runs(stack.workdir, cut.name)) >= start + 2 * BATCH, 60,
                   "the host to be running batches")
        cut.cut()
        cut_at = time.time()
        # What Redis records as running on the cut host now is all it may run twice: it can
        # start nothing more (its start cannot reach Redis), and what it finished before, it
        # stored. (Its runs log read a second later missed that batch when it logged later.)
        at_cut = _running_on(stack, feed, cut.name)
        before = [j for j in feed.jobs if j[0] <= cut_at]
        time.sleep(max(cut_s - (time.time() - cut_at), 0))  # the fault's length
        cut.heal()
        healed_at = time.time()
        # It rejoins by itself: consuming again, and running jobs submitted after the heal.
        wait_until(lambda: set(_runs(stack.workdir, cut.name)) & {t for _, t, _ in
                                                                   feed.since(healed_at)},
                   RECOVERY_S, "the healed host to run new jobs")
        rejoined_at = time.time()
        # Its announcement as consuming is renewed on its next tick, which may come a moment
        # after its first batch (the tick at the heal failed on a connection still stale).
        wait_until(lambda: len(_consuming(stack)) == 2, settings.heartbeat_ttl_s,
                   "the healed host announced consuming again")
    finally:
        feed.stop.set()
        feed.thread.join(30)
    records = _final(stack, [job_id for _, _, job_id in feed.jobs], RECOVERY_S)
    lost = {i for i, r in records.items() if r["status"] == "queued"}
    assert {r["status"] for i, r in records.items() if i not in lost} == {"succeeded"}
    # The jobs it held at the cut finished on the other host within 60 s of the cut.
    late = [r for _, _, i in before if _finished_at(r := records[i]) > cut_at + RECOVERY_S]
    assert late == []
    during = [r for r in records.values() if cut_at < _finished_at(r) < healed_at]
    assert during and all(f"@{other.name}/" in fields(stack.redis, r['id']).get("worker")
                          for r in during)
    # Only the batch it was running at the cut ran twice.
    counts = collections.Counter(_runs(stack.workdir, cut.name) + _runs(stack.workdir,
                                                                          other.name))
    twice = {token for token, n in counts.items() if n > 1}
    last = max((_finished_at(records[i]) for _, _, i in before if i not in lost), default=cut_at)
    print(f"\nhost cut off {cut_s}s: {len(feed.jobs)} jobs, the last held at the cut done "
          f"{last - cut_at:.1f}s after it, {len(twice)} ran twice, {len(lost)} lost; "
          f"rejoined {rejoined_at - healed_at:.1f}s after the heal")
    assert twice <= at_cut and len(twice) <= BATCH, (twice, at_cut)
    assert all(n <= 2 for n in counts.values())
    assert lost == set(), f"{len(lost)} job(s) never finished: {sorted(lost)}"


def _running_on(stack, feed: Feed, host: str) -> set[str]:
    """The tokens of the fed jobs whose record says a child on `host` runs them now."""
    jobs = list(feed.jobs)
    records = fields_of(stack.redis, [job_id for _, _, job_id in jobs])
    return {token for _, token, job_id in jobs if records[job_id].get("status") == "running"
            and f"@{host}/" in records[job_id].get("worker", "")}


def _final(stack, ids: list[str], timeout: float) -> dict[str, dict]:
    """Each job as it stands once all are terminal, or at `timeout`."""
    deadline, out = time.monotonic() + timeout, {}
    for job_id in ids:
        body = stack.job(job_id)
        while body["status"] in ("queued", "running") and time.monotonic() < deadline:
            body = stack.job(job_id, wait=max(min(5.0, deadline - time.monotonic()), 0.5))
        out[job_id] = body
    return out


@pytest.mark.skipif(NETEM_WHY is not None, reason=str(NETEM_WHY))
def test_workers_behind_a_few_milliseconds_of_latency_serve_every_job(two_hosts):
    stack, hosts = two_hosts
    for host in hosts:
        host.delay(5)
    jobs = [stack.submit("work", [uuid.uuid4().hex]) for _ in range(40)]
    assert {stack.finished(j["id"], timeout=120)["status"] for j in jobs} == {"succeeded"}
    nodes = {fields(stack.redis, j['id']).get("worker").split("@")[1].split("/")[0]
             for j in jobs}
    assert nodes == {h.name for h in hosts}
