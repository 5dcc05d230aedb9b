"""A whole stack for tests: Redis, workers, the API; and the client helpers tests use."""
from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import redis
import requests
import yaml

from tests.support.services import (Service, start_redis, start_web, start_worker,
                                    wait_until)


@dataclass
class Stack:
    api: str
    redis_url: str
    env: dict[str, str]
    workdir: Path
    redis_svc: Service
    workers: dict[str, Service]
    web: Service

    @property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, decode_responses=True)

    def submit(self, model: str, inputs: list, **extra) -> dict:
        headers = extra.pop("headers", None)
        r = requests.post(f"{self.api}/v1/jobs", json={"model": model, "inputs": inputs, **extra},
                          headers=headers, timeout=10)
        assert r.status_code == 202, r.text
        return r.json()

    def job(self, job_id: str, wait: float | None = None) -> dict:
        params = {"wait": wait} if wait else None
        r = requests.get(f"{self.api}/v1/jobs/{job_id}", params=params, timeout=(wait or 0) + 10)
        assert r.status_code == 200, r.text
        return r.json()

    def finished(self, job_id: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            body = self.job(job_id, wait=min(10.0, max(deadline - time.monotonic(), 0.5)))
            if body["status"] in ("succeeded", "failed", "cancelled", "expired"):
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not finished after {timeout}s: {body}")

    def declared(self, model: str) -> dict:
        """The model's declaration in the stack's models file."""
        return yaml.safe_load((self.workdir / "models.yaml").read_text())["models"][model]

    def logs(self) -> str:
        return "\n".join(f"--- {s.name}\n{s.tail()}" for s in
                         [self.redis_svc, self.web, *self.workers.values()])

    def wait_live(self, models: list[str], timeout: float) -> None:
        """Until each model has a live instance as /readyz counts them: a pool child with it
        loaded, in a worker that is consuming."""
        def live() -> bool:
            checks = requests.get(f"{self.api}/readyz", timeout=5).json()["checks"]
            return all(checks[f"model:{m}"]["instances"] > 0 for m in models)

        wait_until(live, timeout, f"live workers for {', '.join(models)}")

    def stop(self) -> None:
        for svc in (self.web, *self.workers.values(), self.redis_svc):
            svc.stop()


def launch(workdir: Path, models: dict, workers: dict[str, list[str]],
           env_extra: dict[str, str] | None = None, appendonly: bool = False,
           ready_models: list[str] | None = None, defaults: bool = False) -> Stack:
    """Start Redis, one single-child worker per entry of `workers` (name → queues) and the
    API; return once each model in `ready_models` (default: all) has a live instance.
    Heartbeats are quicker than the defaults, so that tests see workers come and go sooner,
    unless `defaults`: then every setting is what a user runs (no IQ_* but the models file)."""
    models_file = workdir / "models.yaml"
    models_file.write_text(yaml.safe_dump({"models": models}))
    redis_svc = start_redis(workdir, appendonly=appendonly)
    base = {k: v for k, v in os.environ.items() if not k.startswith("IQ_")}
    quick = {} if defaults else {"IQ_HEARTBEAT_INTERVAL_S": "0.5", "IQ_HEARTBEAT_TTL_S": "3"}
    # A webhook secret, as `make run` generates one: without it webhooks are off.
    env = dict(base, REDIS_URL=redis_svc.extra["url"], IQ_MODELS_FILE=str(models_file),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
               IQ_WEBHOOK_SECRET=secrets.token_hex(16), **quick)
    env.update(env_extra or {})
    procs = {name: start_worker(name, env, workdir, queues) for name, queues in workers.items()}
    web = start_web(env, workdir)
    stack = Stack(web.extra["url"], redis_svc.extra["url"], env, workdir, redis_svc, procs, web)
    try:
        stack.wait_live(list(models) if ready_models is None else ready_models, 180)
    except TimeoutError:
        print(stack.logs())
        stack.stop()
        raise
    return stack
