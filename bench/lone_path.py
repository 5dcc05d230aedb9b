"""Where a lone job's time goes between the client and the model: its stack (one worker, one
child, the gevent API) gets one client submitting one-input jobs back to back with
`Prefer: wait`, while Redis's MONITOR stamps every command with Redis's clock (the same host
clock as the client's). Each job's own commands mark the hops of its path:

    client sends → API's submit script → worker main's fetch script (its record) →
    child's start script → child's finish script (its "done", and the job itself sent on its
    API process's reply channel: issue 40; before it, the API read the job after the "done")
    → client has the answer

    python -m bench.lone_path --model synthetic --jobs 300 [--out FILE]
    python -m bench.lone_path --jobs 150 --rounds 4 --baseline COMMIT

prints the p50, p99 and mean of each stretch in ms, the total's overhead over the model's own
call (the synthetic model's sleep, `base_ms + per_item_ms`), and one job's commands. Inside the
stretches, `detail` stamps the scripts' own time in Redis (from their EVALSHA to their last
command: the submit's wake-up push, the finish's last announcement) and the worker main's next
command on its fetch connection after the fetch (its next wait: kombu's BRPOP re-issued), and
the finish's reply to the client (the pub/sub hop, the API's answer, HTTP). MONITOR slows
Redis a little, so the total runs a little above `python -m bench`'s lone job.

With `--baseline COMMIT` that commit's tree (bench/baseline.py) runs the same jobs, the two
alternating round by round (`--rounds`, each a fresh stack, the order swapped every round), so
that a machine that drifts drifts for both.
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from time import time
from types import SimpleNamespace
from urllib.parse import urlparse

import redis
import requests

from bench.harness import MODELS, Config, configs_for, start_stack
from bench.load import make_inputs
from scripts.stack import wait_until

STRETCHES = ("client → submit", "submit → fetch", "fetch → start", "start → finish",
             "finish → client", "total")
# Stamps inside the stretches above (each a part of one of them, not summed with them).
DETAIL = ("submit script", "fetch → main's next wait", "finish script", "finish's reply → client")


class Monitor:
    """Redis's MONITOR in a thread: (time, client, command) for every command.

    It stops at a marker command of its own, not at a flag: the listener may run behind
    Redis, and a flag checked as it reads would drop the commands it has not read yet (the
    last job's read, say)."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.commands: list[tuple[float, str, str]] = []
        self._marker = f"iq-lone-path-stop-{uuid.uuid4().hex}"
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        with self.client.monitor() as monitor:
            self._ready.set()
            for c in monitor.listen():
                if self._marker in c["command"]:
                    return
                self.commands.append((c["time"], f"{c['client_address']}:{c['client_port']}",
                                      c["command"]))

    def stop(self) -> None:
        self.client.echo(self._marker)
        self._thread.join(30)
        if self._thread.is_alive():
            raise RuntimeError("MONITOR's listener did not reach its stop marker in 30 s")


def names_job(job_id: str, command: str) -> bool:
    """Whether a command names the job's record key as a whole word (wherever it stands)."""
    return f"iq:job:{job_id} " in command + " "


def _script_end(commands: list[tuple[float, str, str]], at: int) -> float:
    """When the script whose EVALSHA is commands[at] ran its last command (MONITOR lists a
    script's commands, client "lua", right after its call: Redis runs one at a time)."""
    end = commands[at][0]
    for t, who, _cmd in commands[at + 1:]:
        if who != "lua:":
            break
        end = t
    return end


def stretches(job_id: str, sent: float, answered: float,
              commands: list[tuple[float, str, str]]) -> dict[str, float] | None:
    """A job's stretches in seconds, from its scripts: the ones that name its record (submit,
    start, finish) and the first fetch script after its submit. The finish sends the job to
    the waiting API process, which answers from it with no read. Its `detail` (DETAIL) too."""
    scripts = [(n, t, who) for n, (t, who, cmd) in enumerate(commands)
               if cmd.startswith("EVALSHA") and names_job(job_id, cmd)]
    if len(scripts) < 3:
        return None
    (n_submit, submit, api), (_, start, child), (n_finish, finish, _) = scripts[:3]
    found = next(((n, t, who) for n, (t, who, cmd) in enumerate(commands)
                  if submit < t < start and cmd.startswith("EVALSHA")
                  and who not in (api, child)), None)
    if found is None:
        return None
    n_fetch, fetch, main = found
    marks = [sent, submit, fetch, start, finish, answered]
    out = {name: b - a for name, a, b in zip(STRETCHES, marks, marks[1:])}
    out["total"] = answered - sent
    after = next((t for t, who, _cmd in commands[n_fetch + 1:] if who == main), None)
    finish_end = _script_end(commands, n_finish)
    out["detail"] = {"submit script": _script_end(commands, n_submit) - submit,
                     "fetch → main's next wait": None if after is None else after - fetch,
                     "finish script": finish_end - finish,
                     "finish's reply → client": answered - finish_end}
    return out


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": round(1000 * statistics.median(ordered), 3),
            "p99": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
            "mean": round(1000 * statistics.mean(ordered), 3)}


def one_round(model: str, config: Config, jobs: int) -> tuple[list, list]:
    """`jobs` lone jobs through a fresh stack of `config`: (job id, sent, answered) each, and
    Redis's commands meanwhile."""
    spec = MODELS[model]
    args = SimpleNamespace(clients=[1], duration=2.0, warmup=0.0, flow="prefer-wait")
    stack = start_stack(Path(tempfile.mkdtemp(prefix="iq-lone-")), model, spec, config, args)
    try:
        wait_until(lambda: requests.get(f"{stack.url}/readyz", timeout=2).status_code == 200,
                   180, "the worker")
        stack.load(model, 1, 1, args, duration=2.0, warmup=0.5)  # warm
        monitor = Monitor(stack.services[0].extra["admin_url"])
        url = urlparse(stack.url)
        conn = http.client.HTTPConnection(url.hostname, url.port)
        done = []
        for n in range(jobs):
            body = json.dumps({"model": model, "inputs": make_inputs(spec["kind"], 1, n)})
            sent = time()
            conn.request("POST", "/v1/jobs", body=body.encode(),
                         headers={"Content-Type": "application/json", "Prefer": "wait=30"})
            response = conn.getresponse()
            job = json.loads(response.read())
            answered = time()
            if response.status != 201:
                raise RuntimeError(f"job {n}: {response.status} {job}")
            done.append((job["id"], sent, answered))
        monitor.stop()
    finally:
        stack.stop()
    return done, monitor.commands


def report_of(model: str, rounds: list[tuple[list, list]]) -> dict:
    """The stretches of every job of `rounds` (one configuration's), summarised."""
    spec = MODELS[model]
    done, per_job, untraced, round_p50 = [], [], {}, []
    for jobs, commands in rounds:
        for i, a, b in jobs:
            s = stretches(i, a, b, commands)
            if s:
                per_job.append(s)
            else:  # why a job could not be traced: its own commands, for the reader to see
                untraced[i] = [(who, cmd[:160]) for _t, who, cmd in commands if names_job(i, cmd)]
        done += jobs
        round_p50.append(round(1000 * statistics.median(b - a for _i, a, b in jobs), 3))
    model_s = (spec.get("base_ms", 0) + spec.get("per_item_ms", 0)) / 1000
    jobs, commands = rounds[-1]
    _, sent, answered = jobs[len(jobs) // 2]
    out = {
        "model": model, "jobs": len(done), "traced": len(per_job), "untraced": untraced,
        "round_p50_ms": round_p50,  # each round's total, in the order run
        "ms": {name: _summary([s[name] for s in per_job]) for name in STRETCHES}
        if per_job else {},
        "detail_ms": {name: _summary(v) for name in DETAIL
                      if (v := [s["detail"][name] for s in per_job
                                if s["detail"][name] is not None])},
        "one_job": [(round(1000 * (t - sent), 3), who, cmd[:160])
                    for t, who, cmd in commands if sent <= t <= answered],
    }
    if model_s and per_job:
        # The model's own call is its sleep: what the queue path adds is the rest.
        out["model_ms"] = round(1000 * model_s, 3)
        out["over_model_ms"] = _summary([s["total"] - model_s for s in per_job])
    return out


def measure(model: str, jobs: int, rounds: int = 1, baseline_rev: str | None = None) -> dict:
    """This tree's report; with `baseline_rev`, that commit's beside it ("baseline"), the two
    alternating round by round."""
    configs = configs_for(MODELS[model], baseline_rev)
    ours = next(c for c in configs if c.name == "service")
    theirs = next((c for c in configs if c.name == f"{baseline_rev} prefer-wait"), None)
    order = [ours] if theirs is None else [ours, theirs]
    taken: dict[str, list] = {c.name: [] for c in order}
    for r in range(rounds):
        for config in order if r % 2 == 0 else order[::-1]:
            taken[config.name].append(one_round(model, config, jobs))
    report = report_of(model, taken[ours.name])
    if theirs is not None:
        report["baseline"] = dict(report_of(model, taken[theirs.name]), commit=baseline_rev)
    report["rounds"] = rounds
    return report


def _print(report: dict) -> None:
    for name, ms in list(report["ms"].items()) + list(report["detail_ms"].items()):
        print(f"{name:26s} p50 {ms['p50']:8.3f}  p99 {ms['p99']:8.3f}  mean {ms['mean']:8.3f} ms")
    if "over_model_ms" in report:
        ms = report["over_model_ms"]
        print(f"{'over the model':26s} p50 {ms['p50']:8.3f}  p99 {ms['p99']:8.3f}  mean "
              f"{ms['mean']:8.3f} ms (the model {report['model_ms']} ms)")
    print(f"each round's p50 (ms): {report['round_p50_ms']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic", choices=sorted(MODELS))
    p.add_argument("--jobs", type=int, default=300, help="jobs a round")
    p.add_argument("--rounds", type=int, default=1, help="stacks of each tree, in turn")
    p.add_argument("--baseline", metavar="COMMIT", default=None,
                   help="also this commit's tree, alternating with this one (bench/baseline.py)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args()
    report = measure(a.model, a.jobs, a.rounds, a.baseline)
    _print(report)
    print(f"({report['traced']} of {report['jobs']} jobs traced) one job, ms after it was sent:")
    for t, who, cmd in report["one_job"]:
        print(f"  {t:8.3f}  {who:22s} {cmd}")
    if "baseline" in report:
        print(f"baseline {a.baseline} ({report['baseline']['traced']} of "
              f"{report['baseline']['jobs']} jobs traced):")
        _print(report["baseline"])
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
