"""The game day's traffic, in a process of its own (gevent, so that thousands of jobs can wait
at once without a thread each): open-loop arrivals on a Poisson schedule, one greenlet per
arrival, each a user of the project's Python client (client/inference_queue_client) with its
retries; or, with `--capacity N`, N closed-loop users to measure what the stack can take.

    python -m bench.gameday.traffic --url URL --rate 40 --duration 600 --out jobs.jsonl

Each job's inputs carry a token of their own (`gd-<run>-<seq>`, also its Idempotency-Key, so a
job whose submit never got an answer can be found by it). A job is one input (most) or many
(`--many-share` of them, `--many-inputs` each); half wait with `Prefer: wait` on the submit,
half submit and then wait (`GET ?wait`). Writes one JSON line per job once it is final or its
wait runs out (monotonic times: `arrival` as scheduled, `started` when its user began,
`accepted` when its id came back, `done` when its final status did; `started_wall` and
`done_wall` the same moments by the wall clock, beside the final answer's `created_at`,
`started_at` and `finished_at`, to split its latency into phases, and the items of the model
call that ran it, `batch_items`), then a summary line:
every HTTP answer by method and status, the 5xx among them with their times, the client's
retries with theirs.
"""
from gevent import monkey

monkey.patch_all()

# ruff: noqa: E402 - gevent patches the standard library before anything imports it
import argparse
import collections
import json
import logging
import random
import time

import gevent
import requests
from inference_queue_client import Client, IQError, WaitTimeout

from bench.load import TEXTS

STYLES = ("prefer-wait", "submit-wait")
# The final answer's server times (ISO, the API's wall clock), kept with the client's own
# wall-clock start and end (`started_wall`, `done_wall`: time.time()) to split a job's
# latency into phases (ledger.phases).
SERVER_TIMES = ("created_at", "started_at", "finished_at")


class Recorder(logging.Handler):
    """The client's retries (one WARNING each) and every HTTP answer its sessions got."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.answers: collections.Counter = collections.Counter()
        self.server_errors: list[tuple[float, str, int]] = []
        self.retries: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.retries.append((time.monotonic(), record.getMessage()))

    def answered(self, response: requests.Response, *args, **kwargs) -> None:
        method = response.request.method
        self.answers[f"{method} {response.status_code}"] += 1
        if response.status_code >= 500:
            self.server_errors.append((time.monotonic(), method, response.status_code))


class Users:
    """Clients to hand out, one per greenlet at a time (a client is not shared), each with a
    session whose answers the recorder sees; kept for reuse, so connections are too."""

    def __init__(self, url: str, recorder: Recorder) -> None:
        self.url, self.recorder, self.free = url, recorder, []

    def take(self) -> Client:
        if self.free:
            return self.free.pop()
        session = requests.Session()
        session.hooks["response"].append(self.recorder.answered)
        return Client(self.url, session=session)

    def give(self, client: Client) -> None:
        self.free.append(client)


class Mix:
    """Which job comes next: its inputs (each with the job's token) and its waiting style."""

    def __init__(self, run: str, many_share: float, many_inputs: int, seed: int) -> None:
        self.run, self.many_share, self.many_inputs = run, many_share, many_inputs
        self.rng = random.Random(seed)

    def job(self, seq: int) -> dict:
        token = f"gd-{self.run}-{seq:07d}"
        n = self.many_inputs if self.rng.random() < self.many_share else 1
        inputs = [f"{token}/{i} {TEXTS[self.rng.randrange(len(TEXTS))]}" for i in range(n)]
        return {"seq": seq, "token": token, "inputs": inputs, "style": STYLES[seq % 2]}


def one_job(users: Users, model: str, job: dict, hold: float, deadline: float) -> dict:
    """One user's job: submit (held with `Prefer: wait`, or not), then wait until it is final
    or `deadline` passes. What happened, with its times."""
    client = users.take()
    row = {k: job[k] for k in ("seq", "token", "style", "arrival")}
    row.update(inputs=len(job["inputs"]), started=time.monotonic(), started_wall=time.time())
    try:
        answer = client.submit(model, job["inputs"], idempotency_key=job["token"],
                               wait=hold if job["style"] == "prefer-wait" else None)
        row.update(accepted=time.monotonic(), id=answer.id)
        if not answer.terminal:
            answer = client.wait(answer, timeout=max(deadline - time.monotonic(), 0.1))
        row.update(done=time.monotonic(), done_wall=time.time(), status=answer.status,
                   batch_items=(answer.body.get("batch") or {}).get("items"),
                   **{k: answer.body.get(k) for k in SERVER_TIMES})
    except WaitTimeout as exc:
        row.update(status=exc.job.status, error="WaitTimeout")
    except IQError as exc:
        row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:300],
                   http_status=getattr(exc, "http_status", None))
    finally:
        users.give(client)
    return row


def open_loop(args, out) -> Recorder:
    recorder = Recorder()
    logging.getLogger("inference_queue_client").addHandler(recorder)
    users = Users(args.url, recorder)
    mix = Mix(args.run, args.many_share, args.many_inputs, args.seed)
    arrivals = random.Random(args.seed + 1)
    running: list[gevent.Greenlet] = []

    def job_done(greenlet: gevent.Greenlet) -> None:
        out.write(json.dumps(greenlet.value) + "\n")

    at, seq = args.start, 0
    while True:
        at += arrivals.expovariate(args.rate)
        if at >= args.start + args.duration:
            break
        gevent.sleep(max(at - time.monotonic(), 0))
        job = dict(mix.job(seq), arrival=at)
        seq += 1
        greenlet = gevent.spawn(one_job, users, args.model, job, args.hold, args.deadline)
        greenlet.link_value(job_done)
        running.append(greenlet)
    gevent.joinall(running)
    return recorder


def closed_loop(args) -> dict:
    """`--capacity` users, each submitting the mix and waiting for each job before the next
    (held with `Prefer: wait`): the stack's throughput, measured after `--warmup` s."""
    users = Users(args.url, Recorder())
    mix = Mix(args.run, args.many_share, args.many_inputs, args.seed)
    counted_from = time.monotonic() + args.warmup
    stop_at = counted_from + args.duration
    done: list[dict] = []

    def user(index: int) -> None:
        seq = index
        while time.monotonic() < stop_at:
            job = dict(mix.job(seq), style="prefer-wait", arrival=time.monotonic())
            seq += args.capacity
            row = one_job(users, args.model, job, 30.0, stop_at + 60)
            if row["arrival"] >= counted_from and row.get("status") == "succeeded":
                done.append(row)

    gevent.joinall([gevent.spawn(user, i) for i in range(args.capacity)])
    jobs = [row for row in done if row["done"] <= stop_at]
    return {"users": args.capacity, "seconds": args.duration, "jobs": len(jobs),
            "jobs_per_s": len(jobs) / args.duration,
            "items_per_s": sum(row["inputs"] for row in jobs) / args.duration}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default="minilm-embed")
    parser.add_argument("--run", default="run", help="the tokens' run name")
    parser.add_argument("--rate", type=float, help="arrivals per second (open loop)")
    parser.add_argument("--duration", type=float, required=True, help="seconds of arrivals")
    parser.add_argument("--start", type=float, help="time.monotonic() of the first second "
                        "(default: now)")
    parser.add_argument("--deadline", type=float, help="time.monotonic() after which no job "
                        "waits any longer (default: the last arrival + 120 s)")
    parser.add_argument("--hold", type=float, default=2.0,
                        help="seconds a `Prefer: wait` submit asks the API to hold it")
    parser.add_argument("--many-share", type=float, default=0.1)
    parser.add_argument("--many-inputs", type=int, default=16)
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--out", help="the jobs' JSON lines (open loop)")
    parser.add_argument("--capacity", type=int, help="closed loop: this many users")
    parser.add_argument("--warmup", type=float, default=5.0)
    args = parser.parse_args()
    if not args.capacity and not (args.rate and args.rate > 0):
        parser.error(f"--rate must be > 0 for an open loop, got {args.rate}")
    if args.capacity:
        print(json.dumps(closed_loop(args)))
        return
    args.start = args.start or time.monotonic()
    args.deadline = args.deadline or args.start + args.duration + 120
    with open(args.out, "w", buffering=1) as out:
        recorder = open_loop(args, out)
        out.write(json.dumps({"summary": {
            "answers": dict(recorder.answers), "server_errors": recorder.server_errors,
            "retries": recorder.retries}}) + "\n")


if __name__ == "__main__":
    main()
