"""`make run` (scripts/run.sh, as the Makefile calls it) on a machine that already runs things:
taken ports stop it before it starts anything, a running Redis can be used through REDIS_URL,
the stack it starts is locked and bounded, and Ctrl-C or SIGTERM leaves no process behind.

Every port is a free one and the var directory is the test's own, so that neither another test
run nor a developer's own `make run` on this machine is disturbed."""
from __future__ import annotations

import http.server
import os
import re
import signal
import stat
import subprocess
import threading
from pathlib import Path

import psutil
import pytest
import redis
import requests
import yaml

from inference_queue_client import Client
from scripts.preflight import bind_error
from scripts.stack import ROOT, free_port, start_redis, wait_until

RUN = [str(ROOT / "scripts" / "run.sh")]
PORTS = ("REDIS_PORT", "IQ_PORT", "FLOWER_PORT", "IQ_WORKER_METRICS_PORT",
         "IQ_WEBHOOK_METRICS_PORT")
SECRETS = ("redis-password", "redis-app-password", "flower-password", "webhook-secret")
# Which secret variables each process may hold (scripts/run.py's NEEDS), by its command line;
# with replicas, every process of the application also holds the sentinels' password.
HOLDS = {"redis-server": {"IQ_REDIS_PASSWORD_FILE", "IQ_REDIS_APP_PASSWORD_FILE"},
         "gunicorn": {"REDIS_URL"}, "workers.main worker": {"REDIS_URL"},
         "deliverer.main worker": {"REDIS_URL", "IQ_WEBHOOK_SECRET"},
         "tasks.cli flower": {"REDIS_URL", "FLOWER_BASIC_AUTH"}}
SENTINEL_PASSWORD = "IQ_REDIS_SENTINEL_PASSWORD"
SECRET_VARIABLES = set().union(*HOLDS.values(), {SENTINEL_PASSWORD})

pytestmark = pytest.mark.slow


def start_refused(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`command` (make run) expected to refuse at once; if it started the stack after all, the
    stack is stopped, and its exit status and output say so."""
    run = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = run.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # it started the stack: stop all of it
        os.killpg(run.pid, signal.SIGTERM)
        out, err = run.communicate(timeout=60)
    return subprocess.CompletedProcess(command, run.returncode, out, err)


def run_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("REDIS_URL", "FLOWER_BASIC_AUTH", "IQ_WEBHOOK_SECRET", "IQ_MODELS_FILE")}
    env.update({name: str(free_port()) for name in PORTS}, IQ_VAR_DIR=str(tmp_path / "var"),
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _session(pid: int) -> int | None:
    """The session of `pid`; None when it has exited since it was listed (a restarted part)."""
    try:
        return os.getsid(pid)
    except ProcessLookupError:
        return None


class MakeRun:
    """scripts/run.sh in its own process group, as a terminal runs `make run`."""

    def __init__(self, env: dict[str, str], log: Path, tee: bool = False,
                 command: list[str] = RUN) -> None:
        """`tee`: as `make run 2>&1 | tee LOG`, the pipeline in one process group; `command`:
        what runs scripts/run.sh (it execs it, keeping its pid)."""
        self.env, self.log = env, log
        if tee:
            self.proc = subprocess.Popen(["bash", "-c", f"{RUN[0]} 2>&1 | tee {log}"],
                                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        else:
            with open(log, "ab") as out:
                self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        self.sessions: set[int] = {self.proc.pid}

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_up(self, timeout: float) -> str:
        """The what-is-where block, once printed; meanwhile, every session it started."""
        def block() -> str | None:
            assert self.proc.poll() is None, f"make run exited:\n{self.output()[-3000:]}"
            lines = self.output().splitlines()
            starts = [i for i, line in enumerate(lines) if line.endswith("inference-queue is up")]
            return "\n".join(lines[starts[0]:starts[0] + 7]) if starts else None

        return wait_until(block, timeout, "the what-is-where block")

    def processes(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def stop(self, sig: int = signal.SIGINT, group: bool = True) -> int | None:
        """Signal make run (its process group, as Ctrl-C does, or itself) and wait."""
        if self.proc.poll() is None:
            self.sessions |= {sid for p in self.processes() if (sid := _session(p.pid))}
            (os.killpg if group else os.kill)(self.proc.pid, sig)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            return None

    def reap(self) -> None:
        """After the checks: kill whatever this test started that is still there."""
        for pid in self.sessions:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def left_behind(self) -> list[str]:
        found = []
        for proc in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                if os.getsid(proc.pid) in self.sessions and \
                        proc.info["status"] != psutil.STATUS_ZOMBIE:
                    found.append(f"{proc.pid} {' '.join(proc.info['cmdline'] or [])}")
            except (ProcessLookupError, PermissionError):
                pass
        return found

    def ports_in_use(self) -> list[str]:
        return [name for name in PORTS if self.env.get(name)
                and bind_error("127.0.0.1", int(self.env[name])) is not None]


def secret(env: dict[str, str], name: str) -> str:
    return (Path(env["IQ_VAR_DIR"]) / "secrets" / name).read_text().strip()


def job_result(api: str, model: str, inputs: list) -> dict:
    r = requests.post(f"{api}/v1/jobs", json={"model": model, "inputs": inputs}, timeout=10)
    assert r.status_code == 202, r.text
    url = f"{api}{r.json()['url']}"
    return wait_until(lambda: (body := requests.get(url, params={"wait": 5}, timeout=15).json())
                      ["status"] == "succeeded" and body, 120, "the job to succeed")


def check_app_user_and_files(env: dict[str, str], port: int) -> None:
    """The application's Redis user may not administer Redis; Redis's files are private."""
    app = redis.Redis.from_url(f"redis://iq:{secret(env, 'redis-app-password')}@127.0.0.1:"
                               f"{port}/0")
    assert app.set("iq:acl-probe", "1") and app.info("memory")["maxmemory"] > 0
    for command in (("CONFIG", "SET", "dir", "/tmp"), ("SAVE",), ("MODULE", "LIST"),
                    ("DEBUG", "SLEEP", "0"), ("SHUTDOWN", "NOSAVE"), ("ACL", "LIST"),
                    ("CLIENT", "KILL", "TYPE", "normal"), ("FLUSHALL",), ("KEYS", "*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            app.execute_command(*command)
    data = Path(env["IQ_VAR_DIR"]) / "redis"
    files = [p for p in data.rglob("*") if p.is_file()]
    assert files, "Redis wrote no file"
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == \
        {p.name: 0o600 for p in files}


def check_each_process_holds_only_its_secrets(run: "MakeRun", env: dict[str, str],
                                              sentinels: bool = False) -> None:
    admin, flower = secret(env, "redis-password"), secret(env, "flower-password")
    webhook = secret(env, "webhook-secret")
    seen = set()
    for proc in run.processes():
        cmd = " ".join(proc.cmdline())
        role = next((r for r in HOLDS if r in cmd), None)
        if role is None:
            continue  # a pool child or a shell: it holds what its parent holds
        seen.add(role)
        if role == "redis-server":
            continue  # it writes its process title over its environment: /proc shows none
        environ = proc.environ()
        holds = HOLDS[role] | ({SENTINEL_PASSWORD} if sentinels else set())
        assert SECRET_VARIABLES & set(environ) == holds, (role, sorted(environ))
        values = " ".join(environ.values())
        assert admin not in values and (flower not in values or role == "tasks.cli flower")
        assert webhook not in values or role == "deliverer.main worker"
    assert seen == set(HOLDS)


def test_a_redis_on_its_port_stops_make_run_with_the_variable_to_set(tmp_path):
    foreign = start_redis(tmp_path, open_to_all=True)  # as a system package leaves one
    try:
        port = foreign.extra["port"]
        env = run_env(tmp_path, REDIS_PORT=str(port))
        done = subprocess.run(RUN, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode != 0
        assert (f"port {port} for Redis (REDIS_PORT) is in use by a Redis server that answers "
                "PING") in done.stderr
        assert f"REDIS_URL=redis://127.0.0.1:{port}/0 make run" in done.stderr
        assert re.search(r"REDIS_PORT=\d+ make run", done.stderr)
        assert not (tmp_path / "var").exists()  # nothing made before the ports are known free
        assert redis.Redis.from_url(foreign.extra["url"]).ping()
    finally:
        foreign.stop()


@pytest.mark.parametrize("variable", ["IQ_PORT", "FLOWER_PORT", "IQ_WORKER_METRICS_PORT",
                                      "IQ_WEBHOOK_METRICS_PORT"])
def test_an_http_server_on_a_port_stops_make_run_naming_it(tmp_path, variable):
    class Handler(http.server.BaseHTTPRequestHandler):
        server_version, sys_version = "someone-elses-server/1.0", ""

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        env = run_env(tmp_path, **{variable: str(port)})
        done = subprocess.run(RUN, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode != 0
        assert (f"port {port} for " in done.stderr and f"({variable}) is in use by an HTTP "
                "server (someone-elses-server/1.0)" in done.stderr), done.stderr
        assert re.search(rf"Move it to a free port: +{variable}=\d+ make run", done.stderr)
        assert "REDIS_PORT" not in done.stderr  # only the port at fault is named
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("case", ["group", "weights"])
def test_a_models_file_its_processes_cannot_serve_stops_make_run_before_anything_starts(
        tmp_path, case):
    """A model on a Redis group these settings lack, or a model file that is not there: every
    API and worker process would stop on it at its start, and make run's keepers would start
    them again for ever (30 exits in 75 s, never "up"). make run says why in one line naming
    the field, and starts nothing."""
    models = tmp_path / "models.yaml"
    model = {"group": {"kind": "synthetic", "redis": "gpu"},
             "weights": {"kind": "torchscript", "path": str(tmp_path / "nowhere.pt"),
                         "input_shape": [1]}}[case]
    models.write_text(yaml.safe_dump({"models": {"alpha": model}}))
    env = run_env(tmp_path, IQ_MODELS_FILE=str(models))
    done = start_refused(RUN, env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.splitlines() == [{
        "group": "make run: models.alpha: redis must name a group of redis_groups (none is "
                 "configured), got 'gpu'",
        "weights": f"make run: models.alpha: {tmp_path / 'nowhere.pt'} does not exist"}[case]]
    assert not (tmp_path / "var").exists()  # nothing made, nothing started
    assert all(bind_error("127.0.0.1", int(env[name])) is None for name in PORTS)


def test_make_run_on_a_running_redis_serves_a_job_and_ctrl_c_leaves_nothing(tmp_path):
    """The shipped models and settings, on a Redis that was already running (with a password,
    in REDIS_URL): up, says what is where, serves a job, and Ctrl-C stops all it started."""
    foreign = start_redis(tmp_path)
    env = run_env(tmp_path, REDIS_URL=foreign.extra["url"])
    run = MakeRun(env, tmp_path / "make-run.log")
    try:
        block = run.wait_up(300)
        api = f"http://127.0.0.1:{env['IQ_PORT']}"
        flower = f"http://127.0.0.1:{env['FLOWER_PORT']}"
        assert f"API       {api}" in block
        assert f"Flower    {flower}   user admin, password in {env['IQ_VAR_DIR']}/secrets/" \
               "flower-password" in block
        assert f"{api}/metrics (API), http://127.0.0.1:{env['IQ_WORKER_METRICS_PORT']}" \
               "/metrics (worker)" in block
        assert f"http://127.0.0.1:{env['IQ_WEBHOOK_METRICS_PORT']}/metrics (webhook " \
               "deliverer)" in block  # printed once it answers
        assert f"redis://iq:**@127.0.0.1:{foreign.extra['port']}/0   from REDIS_URL" in block
        assert "kill -TERM" in block

        outputs = job_result(api, "minilm-embed", ["hello world"])["result"]["outputs"]
        assert len(outputs) == 1 and len(outputs[0]) == 384

        password = secret(env, "flower-password")
        assert requests.get(f"{flower}/api/workers", timeout=5).status_code == 401
        assert requests.get(f"{flower}/api/workers", auth=("admin", password),
                            timeout=5).status_code == 200
        hidden = [password, secret(env, "webhook-secret"), foreign.extra["password"],
                  foreign.extra["app_password"]]
        for proc in run.processes():
            assert not any(s in " ".join(proc.cmdline()) for s in hidden), proc.cmdline()
        assert not any(s in run.output() for s in hidden)
        for name in ("flower-password", "webhook-secret"):
            assert stat.S_IMODE((Path(env["IQ_VAR_DIR"]) / "secrets" / name).stat().st_mode) \
                == 0o600
        metrics_port = int(env["IQ_WORKER_METRICS_PORT"])
        assert {c.laddr.ip for c in psutil.net_connections("tcp") if c.laddr
                and c.laddr.port == metrics_port and c.status == "LISTEN"} == {"127.0.0.1"}

        # One line per model with device, dtype and load time; no progress bars as warnings.
        log = run.output()
        for model in ("minilm-embed", "minilm-classify"):
            line = rf"model {model} version \S+ ready on cpu \(float32\) in \d+\.\ds"
            assert len(re.findall(line, log)) == 1, log[-3000:]
        assert "Loading weights" not in log and "celery.redirected" not in log
    finally:
        run.stop(signal.SIGINT)  # Ctrl-C: the terminal signals the whole process group
        left, busy = run.left_behind(), run.ports_in_use()
        run.reap()
        foreign_alive = redis.Redis.from_url(foreign.extra["url"]).ping()
        foreign.stop()
    assert left == [] and busy == []
    assert foreign_alive  # not make run's to stop


def test_make_runs_own_redis_is_locked_and_bounded_and_a_second_run_starts_cleanly(tmp_path):
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": {"synthetic": {
        "kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}}))
    env = run_env(tmp_path, IQ_MODELS_FILE=str(models), REDIS_MAXMEMORY="64mb")
    first = MakeRun(env, tmp_path / "first.log")
    try:
        block = first.wait_up(120)
        password = secret(env, "redis-password")
        port = int(env["REDIS_PORT"])
        assert f"redis://iq:**@127.0.0.1:{port}/0   started here: user iq (no admin " \
               "commands)" in block
        secrets_dir = Path(env["IQ_VAR_DIR"]) / "secrets"
        assert stat.S_IMODE(secrets_dir.stat().st_mode) == 0o700
        assert {stat.S_IMODE((secrets_dir / n).stat().st_mode) for n in SECRETS} == {0o600}
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        locked = redis.Redis(port=port, password=password, decode_responses=True)
        assert locked.config_get("maxmemory")["maxmemory"] == str(64 * 2**20)
        assert locked.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        check_app_user_and_files(env, port)
        started = [" ".join(proc.cmdline()) for proc in first.processes()]
        for process in ("redis-server", "gunicorn", "workers.main worker --pool prefork",
                        "deliverer.main worker --pool threads", "tasks.cli flower"):
            assert any(process in cmd for cmd in started), started  # what must stop later
        assert not any(password in cmd for cmd in started)
        check_each_process_holds_only_its_secrets(first, env)
        api = f"http://127.0.0.1:{env['IQ_PORT']}"
        job = job_result(api, "synthetic", ["abc"])
        assert job["result"]["outputs"] == [3]

        # A part that dies is started again, and says so; the rest stays up.
        for part in ("redis-server", "workers.main worker"):
            victim = next(p for p in first.processes() if part in " ".join(p.cmdline())
                          and "scripts.respawn" not in " ".join(p.cmdline()))
            victim.kill()
        wait_until(lambda: all(f"{name} exited with code" in first.output()
                               for name in ("redis", "worker")), 30, "the restarts said")
        assert job_result(api, "synthetic", ["abcd"])["result"]["outputs"] == [4]
        assert first.proc.poll() is None

        # A second `make run` beside the first: refused, and told what holds each port.
        done = subprocess.run(RUN, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode != 0
        assert f"port {port} for Redis (REDIS_PORT) is in use by this project's own Redis" \
            in done.stderr
        assert "(IQ_PORT) is in use by an HTTP server (gunicorn)" in done.stderr
    finally:
        first.stop(signal.SIGTERM, group=False)  # SIGTERM to make run alone, as `kill` does
        left, busy = first.left_behind(), first.ports_in_use()
        first.reap()
    assert left == [] and busy == []

    # Files left readable by an earlier version are made private by the next run.
    data = Path(env["IQ_VAR_DIR"]) / "redis"
    data.chmod(0o755)
    for path in data.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    second = MakeRun(env, tmp_path / "second.log")
    try:
        second.wait_up(120)
        check_app_user_and_files(env, port)
        assert secret(env, "redis-password") == password  # kept, not made anew
        again = requests.get(f"{api}/v1/jobs/{job['id']}", timeout=10).json()
        assert again["status"] == "succeeded"  # the first run's data survived it
    finally:
        second.stop(signal.SIGINT)
        left, busy = second.left_behind(), second.ports_in_use()
        second.reap()
    assert left == [] and busy == []


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports."""
    def run_of_free() -> int | None:
        first = free_port()
        ok = all(bind_error("127.0.0.1", first + i) is None for i in range(count))
        return first if ok and first + count <= 65535 else None

    return wait_until(run_of_free, 10, f"{count} consecutive free ports")


def replica_in_sync(node: redis.Redis, primary_port: int) -> bool:
    links = node.info("replication")
    return links.get("master_port") == primary_port and links.get("master_link_status") == "up"


def test_make_run_with_a_replica_and_sentinels_follows_a_failover_and_restarts_on_it(tmp_path):
    """REDIS_REPLICAS=1: a primary, a replica and three sentinels, every process pointed at
    the sentinels; a failover is followed without a restart, and the next make run starts the
    promoted node as the primary, its data kept."""
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": {"synthetic": {
        "kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}}))
    port, sentinel = free_ports(2), free_ports(3)
    env = run_env(tmp_path, IQ_MODELS_FILE=str(models), REDIS_REPLICAS="1",
                  REDIS_PORT=str(port), REDIS_SENTINEL_PORT=str(sentinel))
    api = f"http://127.0.0.1:{env['IQ_PORT']}"
    first = MakeRun(env, tmp_path / "first.log")
    try:
        block = first.wait_up(120)
        assert f"primary on {port}, replica(s) on {port + 1}, sentinels on {sentinel}-" \
               f"{sentinel + 2} (master mymaster)" in block
        job = job_result(api, "synthetic", ["abc"])
        check_each_process_holds_only_its_secrets(first, env, sentinels=True)
        admin = redis.Redis(port=sentinel, password=secret(env, "redis-password"),
                            decode_responses=True)
        # A replica the sentinel has only heard of (from the primary's INFO) is no candidate
        # yet (NOGOODSLAVE): wait until it has reached it and read its link to the primary.
        wait_until(lambda: any(r["master-link-status"] == "ok" and not r["is_disconnected"]
                               for r in admin.sentinel_slaves("mymaster")), 30,
                   "the sentinel to reach the replica")
        admin.execute_command("SENTINEL", "FAILOVER", "mymaster")
        wait_until(lambda: admin.sentinel_get_master_addr_by_name("mymaster")[1] == port + 1,
                   60, "the replica promoted")
        # The sentinels demote the old primary at the promotion (scripts/redis-demote.sh), not
        # ~10 s later: the promoted node has its replica back, and takes writes, within seconds.
        old = redis.Redis(port=port, password=secret(env, "redis-password"),
                          decode_responses=True, socket_timeout=5)
        wait_until(lambda: replica_in_sync(old, port + 1), 5,
                   "the old primary a replica in sync with the promoted one")
        # The script says so once its transaction returns; the partial resync can be done
        # before that line has passed through honcho into the log.
        wait_until(lambda: re.search(rf"sentinel-\d.*redis-demote: mymaster 127.0.0.1:{port} "
                                     rf"-> 127.0.0.1:{port + 1} \(\w+\): demoted",
                                     first.output()), 10, "redis-demote's line in the output")
        # Refused (503) until the old primary, now a replica, holds the job too: the client
        # resends with the same Idempotency-Key until it does.
        with Client(api) as client:
            assert client.run("synthetic", ["after the failover"], timeout=60) == [18]
        # `make reload FILE=…` beside it, as the operator runs it (make run's variables, no
        # REDIS_URL): it announces the file on the primary the sentinels name, not on
        # REDIS_PORT's node, a replica now, which would refuse the write.
        changed = tmp_path / "models-changed.yaml"
        changed.write_text(yaml.safe_dump({"models": {"synthetic": {
            "kind": "synthetic", "base_ms": 6, "per_item_ms": 0}}}))
        reloaded = subprocess.run([".venv/bin/python", "-m", "scripts.reload", str(changed),
                                   "--timeout", "120"], cwd=ROOT, env=env, text=True,
                                  capture_output=True, timeout=180)
        assert reloaded.returncode == 0, reloaded.stdout + reloaded.stderr
        assert "reload done" in reloaded.stdout
    finally:
        first.stop(signal.SIGINT)
        left, busy = first.left_behind(), first.ports_in_use()
        first.reap()
    assert left == [] and busy == []
    data = Path(env["IQ_VAR_DIR"])
    assert {stat.S_IMODE(p.stat().st_mode) for p in data.glob("sentinel-*/*")} == {0o600}

    second = MakeRun(env, tmp_path / "second.log")
    try:
        assert f"primary on {port + 1}, replica(s) on {port}," in second.wait_up(120)
        again = requests.get(f"{api}/v1/jobs/{job['id']}", timeout=10).json()
        assert again["status"] == "succeeded"  # kept through the failover and the restart
    finally:
        second.stop(signal.SIGINT)
        left, busy = second.left_behind(), second.ports_in_use()
        second.reap()
    assert left == [] and busy == []


def test_ctrl_c_under_tee_stops_every_process(tmp_path):
    """`make run 2>&1 | tee run.log`, then Ctrl-C: the terminal signals tee as well, so the
    stop's own messages meet a broken pipe; every process stops all the same, and make run
    exits instead of hanging."""
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": {"synthetic": {
        "kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}}))
    env = run_env(tmp_path, IQ_MODELS_FILE=str(models))
    run = MakeRun(env, tmp_path / "tee.log", tee=True)
    try:
        run.wait_up(120)
        started = [" ".join(p.cmdline()) for p in run.processes()]
        assert any("tee" in cmd for cmd in started) and any("gunicorn" in cmd for cmd in started)
    finally:
        code = run.stop(signal.SIGINT)  # Ctrl-C: tee, bash and make run at once
        left, busy = run.left_behind(), run.ports_in_use()
        run.reap()
    assert left == [] and busy == [], left
    assert code is not None  # the pipeline ended: make run did not hang


def test_each_part_holds_only_its_own_secrets_with_redis_groups_and_keys(tmp_path):
    """Issue 37: every process got IQ_REDIS_GROUPS, which carries each group's password; the
    API keys file was named to every process. Read from each running part's /proc environ:
    the API alone holds the groups' passwords and the keys file; the worker, the deliverer
    and Flower check the groups with their passwords hidden; the admin password, the webhook
    secret and Flower's login each where they are used and nowhere else."""
    (tmp_path / "group").mkdir()
    group = start_redis(tmp_path / "group")
    group_password = group.extra["app_password"]
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"name": "a", "sha256": "0" * 64}]}))
    keys.chmod(0o600)
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": {"synthetic": {
        "kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}}))
    env = run_env(tmp_path, IQ_MODELS_FILE=str(models), IQ_API_KEYS_FILE=str(keys),
                  IQ_REDIS_GROUPS=f"gpu={group.extra['url']}")
    run = MakeRun(env, tmp_path / "make-run.log")
    try:
        run.wait_up(180)
        check_each_process_holds_only_its_secrets(run, env)  # the variables of before
        hidden = f"gpu={group.extra['url'].replace(group_password, '**')}"
        seen = {}
        for proc in run.processes():
            cmd = " ".join(proc.cmdline())
            role = next((r for r in HOLDS if r in cmd), None)
            if role is None or role == "redis-server":
                continue  # a pool child or a shell; Redis writes its title over /proc
            environ = proc.environ()
            seen[role] = (environ.get("IQ_REDIS_GROUPS"), environ.get("IQ_API_KEYS_FILE"))
            assert group_password not in " ".join(environ.values()) or role == "gunicorn", role
        assert seen == {"gunicorn": (f"gpu={group.extra['url']}", str(keys)),
                        "workers.main worker": (hidden, None),
                        "deliverer.main worker": (hidden, None),
                        "tasks.cli flower": (hidden, None)}
        # What the API holds, it uses: the group's Redis is checked, the keys are asked for.
        api = f"http://127.0.0.1:{env['IQ_PORT']}"
        ready = requests.get(f"{api}/readyz", timeout=10).json()
        assert "redis:gpu" in str(ready), ready
        assert requests.get(f"{api}/v1/models", timeout=10).status_code == 401
    finally:
        run.stop(signal.SIGINT)
        left, busy = run.left_behind(), run.ports_in_use()
        run.reap()
        group.stop()
    assert left == [] and busy == []
