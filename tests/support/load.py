"""Load for the Redis fault tests: clients of the API, each a thread with the project's Python
client as a user runs it (an Idempotency-Key on every submit; 503 and 429 retried after their
Retry-After, for its default 60 s), submitting one-input jobs with unique inputs until
stopped. Every answer the API gave a submit is kept (when, how long it took, its status), so
that a test can name the slowest; and what each job did is counted per job id."""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis
import requests

from inference_queue_client import Client, IQError

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "expired"})


@dataclass(frozen=True)
class Answer:
    at: float  # time.monotonic() when it came
    took: float  # seconds from the request to the answer
    status: int


class Load:
    def __init__(self, api: str, model: str, tag: str, clients: int = 4,
                 pause_s: float = 0.1) -> None:
        self.api, self.model, self.tag, self.pause_s = api, model, tag, pause_s
        self.accepted: dict[str, str] = {}  # input -> job id, once the client got its 202
        self.gave_up: list[str] = []  # inputs whose client raised after its retries
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(n,), daemon=True)
                         for n in range(clients)]

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout: float = 120) -> None:
        """Stop submitting; returns once every client's last submit is answered."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        assert not any(t.is_alive() for t in self._threads), "a client is still submitting"

    def _timed(self, response: requests.Response, *_args, **_kw) -> None:
        if response.request.method == "POST":
            self.answers.append(Answer(time.monotonic(), response.elapsed.total_seconds(),
                                       response.status_code))

    def _run(self, n: int) -> None:
        session = requests.Session()
        session.hooks["response"].append(self._timed)
        with Client(self.api, session=session) as client:
            i = 0
            while not self._stop.is_set():
                text = f"{self.tag}-{n}-{i}"
                i += 1
                try:
                    self.accepted[text] = client.submit(self.model, [text]).id
                except IQError:
                    self.gave_up.append(text)
                self._stop.wait(self.pause_s)

    def slowest(self, since: float = 0.0) -> float:
        """The longest a submit waited for its answer (since `since`, time.monotonic())."""
        return max(a.took for a in self.answers if a.at >= since)

    def statuses(self) -> collections.Counter:
        return collections.Counter(a.status for a in self.answers)


def job_statuses(client: redis.Redis, job_ids: list[str]) -> dict[str, str | None]:
    """Each job's status, straight from its record."""
    with client.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hget(f"iq:job:{job_id}", "status")
        return dict(zip(job_ids, pipe.execute()))


def runs(log: Path) -> collections.Counter:
    """How many times the synthetic model ran each input (its runs_log)."""
    return collections.Counter(log.read_text().splitlines()) if log.exists() \
        else collections.Counter()


def every_record(admin: redis.Redis) -> set[str]:
    """The id of every job record in this Redis (the admin's client: KEYS)."""
    return {key.split(":", 2)[2] for key in admin.keys("iq:job:*")}

