"""`make run`: the Procfile's processes under honcho, with a Redis of its own unless REDIS_URL
names one.

Before anything starts, every port the stack will bind is checked (scripts/preflight.py). The
secrets it needs are made on first use and kept under IQ_VAR_DIR (default var/), mode 0600, in
files and folders this user made (scripts/var_dir.py): its Redis's admin password and the
application's (an ACL user without administrative commands: scripts/redis-server.sh), Flower's
password, the webhook signing secret. Each process gets only the secrets it uses (`NEEDS`);
with IQ_RUN_USERS=separate (as root), each part runs as a system user of its own, walled off
from the others' secrets and Redis's password files (scripts/run_users.py). Once
the API, the worker and Flower answer, one block says what is where. A process that exits on its
own (a crash, a kill) is started again, its output saying so (scripts/respawn.py), rather than
the whole stack stopped. Ctrl-C, SIGTERM or a hang-up stops every process it started, in order
(scripts/run_stop.py): what takes work first, Redis last, within `stop_timeout_s`. Its
output may go through a pipe (`make run 2>&1 | tee run.log`): when the reader is gone (Ctrl-C
stops `tee` too), the output is dropped rather than the stop (`Console`).
"""
from __future__ import annotations

import datetime
import os
import shlex
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from honcho.environ import parse_procfile
from honcho.manager import Manager
from honcho.printer import Message, Printer
from kombu.utils.url import maybe_sanitize_url

from config import ConfigError, Settings, load_settings
from config.settings import METRICS_FOLDER_VARIABLE
from config.groups import shown_groups
from config.models import read_models_content
from scripts import run_redis, run_users
from scripts.models_as_user import kinds_as_worker
from scripts.models_check import problems_of
from workers.child.devices import visible_gpu_count
from scripts.preflight import REDIS_APP_USER, Binding, Refused, model_file_problems, \
    operator_file_problems, port_problems, reachable
from scripts.run_stop import OrderedManager
from scripts.var_dir import kept_secret, shown, var_problems

ROOT = Path(__file__).resolve().parent.parent
NOT_UP_NOTE_S = 300  # a first model load can take minutes; after this, say what is missing
# The variables that carry a secret, and which of them each process of the Procfile uses: a
# process gets those, and none of the others (a process not named here gets none). Only the
# API reaches the Redis groups' servers (app/group_stores.py); the others check that each model's
# group is configured (tasks/celery_app.py), for which the groups' names and addresses do:
# they get IQ_REDIS_GROUPS with every password hidden (`process_env`). Only the API reads the
# API keys file, only the deliverer signs webhooks, only Flower checks its login, and only
# Redis's own processes read the password files (make run reads the secrets and hands the
# others the values they use: no other process needs var/secrets).
SECRET_VARIABLES = ("REDIS_URL", "IQ_REDIS_SENTINEL_PASSWORD", "IQ_REDIS_PASSWORD_FILE",
                    "IQ_REDIS_APP_PASSWORD_FILE", "FLOWER_BASIC_AUTH", "IQ_WEBHOOK_SECRET",
                    "IQ_REDIS_GROUPS", "IQ_API_KEYS_FILE")
REDIS_NEEDS = {"IQ_REDIS_PASSWORD_FILE", "IQ_REDIS_APP_PASSWORD_FILE"}
NEEDS = {
    "redis": REDIS_NEEDS,  # and each replica and sentinel (scripts/run_redis.py)
    "web": {"REDIS_URL", "IQ_REDIS_SENTINEL_PASSWORD", "IQ_REDIS_GROUPS", "IQ_API_KEYS_FILE"},
    "worker": {"REDIS_URL", "IQ_REDIS_SENTINEL_PASSWORD"},
    "webhooks": {"REDIS_URL", "IQ_REDIS_SENTINEL_PASSWORD", "IQ_WEBHOOK_SECRET"},
    "flower": {"REDIS_URL", "IQ_REDIS_SENTINEL_PASSWORD", "FLOWER_BASIC_AUTH"},
}
# The application's processes that check the groups without reaching them.
GROUP_NAMES_ONLY = {"worker", "webhooks", "flower"}


def _port(env: dict[str, str], variable: str, default: int) -> int:
    raw = env.get(variable) or str(default)
    if not raw.isdigit() or int(raw) > 65535:
        raise Refused(f"make run: {variable} must be a port number (0-65535), got {raw!r}")
    return int(raw)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _announce(manager: Manager, checks: dict[str, str], block: str) -> None:
    """Print `block` through honcho's printer once every check URL answers 200."""
    def say(text: str) -> None:
        manager.events.put(Message("line", text, datetime.datetime.now(), "run", None))

    pending, started, noted, pause = dict(checks), time.monotonic(), False, 0.25
    while pending := {what: url for what, url in pending.items() if not _answers(url)}:
        if not noted and time.monotonic() - started > NOT_UP_NOTE_S:
            say(f"not up after {NOT_UP_NOTE_S} s; still waiting for {', '.join(pending)}")
            noted = True
        # Each try is a line in the API's access log: fewer while models load.
        pause = min(pause * 2, 3.0)
        time.sleep(pause)
    say(block)


def _bindings(env: dict[str, str]) -> dict[str, Binding]:
    metrics_host = env.get("IQ_WORKER_METRICS_HOST") or Settings.worker_metrics_host
    return {
        "redis": Binding("Redis", "REDIS_PORT", "127.0.0.1", _port(env, "REDIS_PORT", 6379)),
        "api": Binding("the API", "IQ_PORT", env.get("IQ_HOST", "127.0.0.1"),
                       _port(env, "IQ_PORT", 8000)),
        "flower": Binding("Flower", "FLOWER_PORT", env.get("FLOWER_HOST", "127.0.0.1"),
                          _port(env, "FLOWER_PORT", 5555)),
        "worker": Binding("the worker's metrics", "IQ_WORKER_METRICS_PORT", metrics_host,
                          _port(env, "IQ_WORKER_METRICS_PORT", Settings.worker_metrics_port)),
        "webhooks": Binding("the webhook deliverer's metrics", "IQ_WEBHOOK_METRICS_PORT",
                            metrics_host,
                            _port(env, "IQ_WEBHOOK_METRICS_PORT", Settings.webhook_metrics_port)),
    }


def _url(binding: Binding, path: str = "") -> str:
    host = reachable(binding.host)
    return f"http://{f'[{host}]' if ':' in host else host}:{binding.port}{path}"


@dataclass
class Run:
    env: dict[str, str]        # every process's environment
    processes: dict[str, str]  # Procfile entries to start: name -> command
    checks: dict[str, str]     # what must answer before the stack counts as up: name -> URL
    block: str                 # what is where, printed once it is up
    # What a process adds to `env` (the replicas' and sentinels' ports and roles).
    own_env: dict[str, dict[str, str]] = field(default_factory=dict)
    # IQ_RUN_USERS=separate: what each process adds to `env` as its own user's (its HOME;
    # Redis's, the copies of its password files: scripts/run_users.py); empty: one user.
    as_users: dict[str, dict[str, str]] = field(default_factory=dict)


def _keep_secrets(env: dict[str, str], var_dir: Path, redis_port: int | None) -> list[str]:
    """Put the Redis URL (when make run starts its Redis; with replicas, the sentinels too),
    Flower's login and the webhook secret into `env`, each from the environment or else kept
    under var_dir; return where each comes from, for the block."""
    if redis_port is None:
        redis = "from REDIS_URL, not started here"
    else:
        _admin, admin_path = kept_secret(var_dir, "redis-password")
        password, path = kept_secret(var_dir, "redis-app-password")
        env.setdefault("IQ_REDIS_DIR", str(var_dir / "redis"))
        env.update(IQ_REDIS_PASSWORD_FILE=str(admin_path), IQ_REDIS_APP_PASSWORD_FILE=str(path),
                   IQ_REDIS_APP_USER=REDIS_APP_USER,
                   REDIS_URL=f"redis://{REDIS_APP_USER}:{password}@127.0.0.1:{redis_port}/0")
        redis = f"started here: user {REDIS_APP_USER} (no admin commands), admin password " \
                f"in {shown(admin_path)}, data in {shown(Path(env['IQ_REDIS_DIR']))}"
        run_redis.min_replicas_to_write(env)  # checked without replicas too
        if run_redis.replicas(env):
            env.update(run_redis.application_env(env, password))
            redis += "; " + run_redis.described(env, redis_port, var_dir)
    if env.get("FLOWER_BASIC_AUTH"):
        login = f"user {env['FLOWER_BASIC_AUTH'].split(':', 1)[0]}, password from " \
                "FLOWER_BASIC_AUTH"
    else:
        password, path = kept_secret(var_dir, "flower-password")
        env["FLOWER_BASIC_AUTH"] = f"admin:{password}"
        login = f"user admin, password in {shown(path)}"
    if env.get("IQ_WEBHOOK_SECRET"):
        signing = "IQ_WEBHOOK_SECRET from the environment"
    else:
        env["IQ_WEBHOOK_SECRET"], path = kept_secret(var_dir, "webhook-secret")
        signing = f"IQ_WEBHOOK_SECRET, kept in {shown(path)}"
    # The API queues deliveries and the deliverer signs them: only the deliverer holds the
    # secret, and the API is told webhooks are on.
    env["IQ_WEBHOOKS_ENABLED"] = "true"
    return [redis, login, signing]


def _own_app_password(env: dict[str, str]) -> str | None:
    path = ROOT / (env.get("IQ_VAR_DIR") or "var") / "secrets" / "redis-app-password"
    return path.read_text().strip() if path.is_file() else None


def own_redis_url(env: dict[str, str]) -> str | None:
    """REDIS_URL when set; else the URL of the Redis `make run` starts, from its kept password
    (for the commands run beside it, such as `make reload`); None when there is neither."""
    if env.get("REDIS_URL"):
        return env["REDIS_URL"]
    password = _own_app_password(env)
    if password is None:
        return None
    port = _port(env, "REDIS_PORT", 6379)
    return f"redis://{REDIS_APP_USER}:{password}@127.0.0.1:{port}/0"


def own_redis_env(env: dict[str, str]) -> dict[str, str]:
    """What a command run beside `make run` (`make reload`) adds to `env` to reach its Redis:
    REDIS_URL (`own_redis_url`) and, when make run replicates the Redis it starts
    (REDIS_REPLICAS), the sentinels, which say where the primary is now: after a failover,
    REDIS_PORT's node is a replica, which refuses every write."""
    url = own_redis_url(env)
    if url is None:
        return {}
    password = None if env.get("REDIS_URL") else _own_app_password(env)
    if password is not None and run_redis.replicas(env):
        return {"REDIS_URL": url, **run_redis.application_env(env, password)}
    return {"REDIS_URL": url}


def process_env(name: str, env: dict[str, str]) -> dict[str, str]:
    """`env` less the secrets process `name` does not use (NEEDS; each Redis process's are
    `redis`'s); IQ_REDIS_GROUPS without its passwords for those that only check the groups."""
    needs = NEEDS.get(name, REDIS_NEEDS if name.startswith(("redis-", "sentinel-")) else set())
    own = {k: v for k, v in env.items() if k not in SECRET_VARIABLES or k in needs}
    if name in GROUP_NAMES_ONLY and env.get("IQ_REDIS_GROUPS"):
        own["IQ_REDIS_GROUPS"] = shown_groups(env["IQ_REDIS_GROUPS"])
    return own


def _models_problems(settings: Settings) -> list[str]:
    """Why the models file cannot start: another user may write it or a model file, or every
    process would stop on it at its start (a model on a Redis group these settings lack, a
    model file that is not there), which under respawn would crash-loop for ever."""
    try:
        return model_file_problems(settings.models_file) + [
            f"make run: {problem}" for problem in problems_of(
                Path(settings.models_file), read_models_content(settings.models_file),
                settings.redis_group_urls, host_gpus=visible_gpu_count(settings))]
    except ConfigError as exc:  # the models file itself is wrong
        return [f"make run: {exc}"]


def plan(environ: dict[str, str]) -> Run:
    """Check the ports, then make or read the secrets (nothing is written when a port is
    taken). With IQ_RUN_USERS=separate, the models file is parsed (its `kinds:` modules
    imported) by a process of the worker's user, never here as root
    (scripts/models_as_user.py)."""
    env = dict(environ)
    try:
        settings = load_settings(environ=env)  # what every process would refuse, refused now
    except ConfigError as error:
        raise Refused(f"make run: {error}") from None
    if METRICS_FOLDER_VARIABLE in env:
        # A folder sums the counters of the processes that write in it: given to every
        # program, the API's /metrics would add in the worker's and Flower's, and theirs the
        # API's. Each program makes its own.
        raise Refused(f"make run: {METRICS_FOLDER_VARIABLE} is one program's folder (the API's, "
                      f"or a worker's); make run runs several, and each makes its own: unset it")
    with kinds_as_worker(settings, env):
        return _planned(env, settings)


def _planned(env: dict[str, str], settings: Settings) -> Run:
    var_dir = ROOT / (env.get("IQ_VAR_DIR") or "var")
    own_redis = not env.get("REDIS_URL")
    ports = _bindings(env)
    if not own_redis:
        del ports["redis"]
    try:
        replicated = run_redis.bindings(env, ports["redis"].port) if own_redis else []
    except ConfigError as error:
        raise Refused(f"make run: {error}") from None
    procfile = parse_procfile((ROOT / "Procfile").read_text()).processes
    processes = {n: cmd for n, cmd in procfile.items() if own_redis or n != "redis"}
    run_users.refuse_unless_served(settings, list(processes), env, var_dir)
    problems = var_problems(var_dir, run_users.redis_uid())
    password_file = var_dir / "secrets" / "redis-password"
    known = password_file.read_text().strip() if not problems and password_file.is_file() \
        else None
    problems += port_problems([b for b in ports.values() if b.port] + replicated, known,
                              shown(password_file))
    problems += _models_problems(settings)
    problems += [f"make run: {line}" for line in
                 operator_file_problems(env.get("IQ_CONFIG", ""), settings.api_keys_file)]
    if problems:
        raise Refused("\n".join(problems))

    env.update({b.variable: str(b.port) for b in ports.values()}, IQ_VAR_DIR=str(var_dir),
               IQ_WORKER_METRICS_HOST=ports["worker"].host)
    redis, login, signing = _keep_secrets(env, var_dir,
                                          ports["redis"].port if own_redis else None)
    api, flower = ports["api"], ports["flower"]
    checks = {"the API's /readyz": _url(api, "/readyz"),
              "Flower": _url(flower, "/healthcheck")}
    metrics = [_url(api, "/metrics") + " (API)"]
    for name, label in (("worker", "worker"), ("webhooks", "webhook deliverer")):
        if ports[name].port:
            checks[ports[name].what] = _url(ports[name], "/metrics")
            metrics.append(_url(ports[name], "/metrics") + f" ({label})")
    metrics.append(_url(flower, "/metrics") + " (Flower)")
    block = "\n".join([
        "inference-queue is up",
        f"  API       {_url(api)}   models: {_url(api, '/v1/models')}",
        f"  Flower    {_url(flower)}   {login}",
        f"  Metrics   {', '.join(metrics)}",
        f"  Redis     {maybe_sanitize_url(env['REDIS_URL'])}   {redis}",
        f"  Webhooks  signed with {signing}",
        f"  Stop      Ctrl-C here, or kill -TERM {os.getpid()}: every process above stops",
    ])
    own_env = run_redis.processes(env, var_dir, ports["redis"].port) \
        if own_redis and replicated else {}
    processes.update({name: procfile["redis"] for name in own_env})
    as_users = run_users.prepare(var_dir, list(processes), env, own_env) \
        if settings.run_users == "separate" else {}
    return Run(env, processes, checks, block, own_env, as_users)


class Console:
    """The stream honcho prints to. Once its reader is gone (a broken pipe: Ctrl-C stopped
    `tee` as well; an EIO: its terminal hung up), what is printed is dropped: an error raised
    in honcho's signal handler would skip the stop, leaving every process running and this one
    hung."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.gone = stream, False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                self.stream.write(text)
            # ValueError: the stream was closed; OSError (EIO): its terminal hung up
            except (OSError, ValueError):
                self._reader_gone()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self._reader_gone()

    def isatty(self) -> bool:
        return not self.gone and self.stream.isatty()

    def _reader_gone(self) -> None:
        self.gone = True
        # Python's own flush of stdout at exit would fail again: point it at nothing.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.stream.fileno())
        os.close(devnull)


def main() -> int:
    try:
        run = plan(dict(os.environ))
    except Refused as refused:
        print(refused, file=sys.stderr)
        return 1
    stop_timeout_s = load_settings(environ=run.env).stop_timeout_s
    run.env["IQ_STOP_TIMEOUT_S"] = str(stop_timeout_s)  # also scripts/flower.sh's bound
    manager = OrderedManager(Printer(Console(sys.stdout)), stop_timeout_s)
    for name, command in run.processes.items():
        user = f"--user {run_users.user_of(name)} " if run.as_users else ""
        kept = f"exec {shlex.quote(sys.executable)} -m scripts.respawn {user}{name} " \
               f"{shlex.quote(command)}"
        env = {**process_env(name, run.env), **run.own_env.get(name, {}),
               **run.as_users.get(name, {})}
        manager.add_process(name, kept, env=env, cwd=str(ROOT))
    # Started before honcho forks its readers; they only start a process and read its output.
    threading.Thread(target=_announce, args=(manager, run.checks, run.block),
                     daemon=True).start()
    manager.loop()
    return manager.returncode or 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C before honcho took over the signals
        sys.exit(130)
