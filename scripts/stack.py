"""A whole stack on one machine, each piece a real process on a free port of 127.0.0.1: a
private redis-server (with a password, as `make run`'s), `celery worker` processes (prefork),
gunicorn serving the app factory, Flower; and `launch`, which starts them together.

What the tests, the benchmarks and scripts/gpu_check.py start, so it lives here rather than
under tests/ (`make run` is scripts/run.py, for people)."""
from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import redis
import requests
import yaml

from scripts.processes import ROOT, VENV_BIN, Service, free_port, spawn, wait_until
from scripts.redis_nodes import RedisGroup, start_group, start_redis, start_redis_url

__all__ = ["ROOT", "VENV_BIN", "RedisGroup", "Service", "Stack", "free_port", "launch",
           "spawn", "start_flower", "start_group", "start_redis", "start_web",
           "start_webhooks", "start_worker", "wait_until"]


def start_worker(name: str, env: dict[str, str], logdir: Path, queues: list[str] | None,
                 concurrency: int = 1, app: str = "workers.main",
                 pool: str = "prefork", wrap: list[str] | None = None) -> Service:
    """A `celery worker` named `name@<host>` on `queues` (None: every model's, as a worker
    started without -Q)."""
    env = dict(env, IQ_WORKER_METRICS_PORT=str(free_port()))
    cmd = [str(VENV_BIN / "celery"), "-A", app, "worker", "--pool", pool,
           "--concurrency", str(concurrency), "--loglevel", "INFO",
           "--hostname", f"{name}@%h"]
    if queues is not None:
        cmd += ["--queues", ",".join(queues)]
    svc = spawn(f"worker-{name}", cmd, env, logdir, wrap)
    svc.extra["metrics_url"] = f"http://127.0.0.1:{env['IQ_WORKER_METRICS_PORT']}/metrics"
    return svc


def start_webhooks(name: str, env: dict[str, str], logdir: Path,
                   concurrency: int = 4) -> Service:
    """The webhook deliverer, as scripts/webhooks.sh runs it; `extra["metrics_url"]` is its
    metrics endpoint."""
    env = dict(env, IQ_WEBHOOK_METRICS_PORT=str(free_port()))
    svc = start_worker(name, env, logdir, ["iq.webhooks"], concurrency=concurrency,
                       app="deliverer.main", pool="threads")
    svc.extra["metrics_url"] = f"http://127.0.0.1:{env['IQ_WEBHOOK_METRICS_PORT']}/metrics"
    return svc


def start_web(env: dict[str, str], logdir: Path, worker_class: str | None = None,
              threads: int = 64) -> Service:
    """The API as `gunicorn app.wsgi:app` runs it here: gunicorn.conf.py's gevent worker, or
    `worker_class="gthread"` with `threads` threads (the thread-per-request design the
    benchmark compares against)."""
    port = free_port()
    cmd = [str(VENV_BIN / "gunicorn"), "--bind", f"127.0.0.1:{port}"]
    if worker_class:
        cmd += ["--worker-class", worker_class, "--threads", str(threads)]
    cmd.append("app.wsgi:app")
    svc = spawn("web", cmd, env, logdir)
    url = f"http://127.0.0.1:{port}"
    try:  # each gunicorn process imports the app; on a loaded 2-core machine one takes seconds
        wait_until(lambda: requests.get(f"{url}/healthz", timeout=2).ok,
                   30 * int(env.get("IQ_WEB_WORKERS") or 1), "the API")
    except BaseException:
        print(svc.tail())
        svc.stop()
        raise
    svc.extra.update(port=port, url=url)
    return svc


def start_flower(env: dict[str, str], logdir: Path, auth: str) -> Service:
    """Flower with its login in the environment, as scripts/flower.sh passes it."""
    port = free_port()
    cmd = [str(VENV_BIN / "celery"), "-A", "tasks.cli", "flower", "--address=127.0.0.1",
           f"--port={port}"]
    svc = spawn("flower", cmd, dict(env, FLOWER_BASIC_AUTH=auth), logdir)
    url = f"http://127.0.0.1:{port}"
    user, password = auth.split(":", 1)
    wait_until(lambda: requests.get(f"{url}/api/workers", auth=(user, password),
                                    timeout=2).ok, 30, "Flower")
    svc.extra.update(port=port, url=url)
    return svc


@dataclass
class Stack:
    api: str
    redis_url: str
    env: dict[str, str]
    workdir: Path
    redis_svc: Service
    workers: dict[str, Service]
    web: Service
    # With `launch(replicated=True)`: the primary, its replica and the sentinels, of which
    # `redis_svc` is the primary (after a failover, the test sets it to the new one).
    group: RedisGroup | None = None

    @property
    def redis(self) -> redis.Redis:
        """A client of `redis_svc` as the application's user (no administrative commands)."""
        return redis.Redis.from_url(self.redis_svc.extra["url"], decode_responses=True)

    @property
    def admin(self) -> redis.Redis:
        """A client as Redis's admin: for tests that reconfigure it or cut its clients."""
        return redis.Redis.from_url(self.redis_svc.extra["admin_url"], decode_responses=True)

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

    def wait_live(self, models: list[str], timeout: float, instances: int = 1) -> None:
        """Until each model has `instances` live instances as /readyz counts them: pool
        children with it loaded, in workers that are consuming (that fetch its jobs)."""
        def live() -> bool:
            checks = requests.get(f"{self.api}/readyz", timeout=5).json()["checks"]
            return all(checks[f"model:{m}"]["instances"] >= instances for m in models)

        wait_until(live, timeout, f"{instances} live instance(s) of {', '.join(models)}")

    def stop(self) -> None:
        """The API and the workers shut down together (each its own warm shutdown), then
        Redis, which they write to until they are gone."""
        front = [svc for svc in (self.web, *self.workers.values()) if svc.send()]
        for svc in front:
            svc.reap()
        if self.group is not None:
            self.group.stop()
        else:
            self.redis_svc.stop()


def launch(workdir: Path, models: dict, workers: dict[str, list[str]],
           env_extra: dict[str, str] | None = None, appendonly: bool = False,
           ready_models: list[str] | None = None, defaults: bool = False,
           replicated: bool = False, bind: list[str] | None = None,
           redis_args: list[str] | None = None, concurrency: int = 1,
           kinds: list[str] | None = None, unix_socket: bool = False) -> Stack:
    """Start Redis, one worker per entry of `workers` (name → queues) with `concurrency` pool
    children each, and the API; return once each model in `ready_models` (default: all) has
    a live instance.
    Heartbeats are quicker than the defaults, so that tests see workers come and go sooner,
    unless `defaults`: then every setting is what a user runs (no IQ_* but the models file
    and, when `replicated`, the sentinels). `replicated`: a primary with append-only file,
    one replica and three sentinels (scripts/redis_nodes.py), every process pointed at the
    sentinels. `bind`: addresses the Redis listens on beside 127.0.0.1 (hosts of their own,
    scripts/hosts.py); `redis_args`: more of redis-server's options (one Redis only).
    `kinds`: the modules of kinds of one's own, the models file's `kinds:`. `unix_socket`:
    the Redis listens on a Unix socket in `workdir` too, and every process's REDIS_URL is
    that socket's (`unix://`; `stack.redis_url` and the service's `extra["url"]` stay TCP's;
    one Redis only: the sentinels of `replicated` name a host)."""
    models_file = workdir / "models.yaml"
    declared = {"models": models, **({"kinds": kinds} if kinds else {})}
    models_file.write_text(yaml.safe_dump(declared))
    if replicated and unix_socket:  # the sentinels name the primary's host, not a socket
        raise ValueError("launch: unix_socket is for one Redis, not with replicated")
    group = start_group(workdir) if replicated else None
    if group is not None:
        redis_svc, url = group.primary, group.primary.extra["url"]
    else:
        redis_svc, url = start_redis_url(workdir, workdir / "redis.sock" if unix_socket else None,
                                         appendonly=appendonly, bind=bind, args=redis_args)
    base = {k: v for k, v in os.environ.items() if not k.startswith("IQ_")}
    quick = {} if defaults else {"IQ_HEARTBEAT_INTERVAL_S": "0.5", "IQ_HEARTBEAT_TTL_S": "3"}
    # A webhook secret, as `make run` generates one: without it webhooks are off.
    env = dict(base, REDIS_URL=url, IQ_MODELS_FILE=str(models_file),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
               IQ_WEBHOOK_SECRET=secrets.token_hex(16), **quick, **(group.env() if group else {}))
    env.update(env_extra or {})
    procs: dict[str, Service] = {}
    try:  # a process that fails to start leaves none of the others running
        for name, queues in workers.items():
            procs[name] = start_worker(name, env, workdir, queues, concurrency)
        web = start_web(env, workdir)
    except BaseException:
        for svc in procs.values():
            svc.stop()
        if group is not None:
            group.stop()
        else:
            redis_svc.stop()
        raise
    stack = Stack(web.extra["url"], redis_svc.extra["url"], env, workdir, redis_svc, procs, web,
                  group)
    try:
        stack.wait_live(list(models) if ready_models is None else ready_models, 180)
    except TimeoutError:
        print(stack.logs())
        stack.stop()
        raise
    return stack
