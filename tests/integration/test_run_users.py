"""`make run` with IQ_RUN_USERS=separate (scripts/run_users.py), as root: each part runs as a
system user of its own (`make users` makes them), none of the application's users can open
Redis's password files or read another part's environment, `make reload` and Ctrl-C work as
with one user, and each start it cannot serve is refused in one line, nothing started.

The var folder and the models file live in a folder of the test's own that the parts' users
may enter (pytest's tmp_path is root's, 0700: the refusal of that is a test here). Where this
machine's Python lies in a folder they may not enter (pyenv under /root, 0700), make run runs
in a mount namespace of its own where that folder is a 0711 one holding only the Python
(`_reachable_python`): the same layout as a Python installed system-wide."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import orjson
import pytest
import redis
import requests
import yaml

from config.models import revision_of
from scripts.preflight import bind_error
from scripts.stack import ROOT, wait_until
from scripts.var_dir import kept_secret
from tasks.keys import MODELS_ANNOUNCEMENTS_KEY, MODELS_REVISION_KEY, RELOAD_STATUS_KEY
from tests.integration.test_make_run import PORTS, MakeRun, RUN, run_env, secret, start_refused
from tests.support.load import Load
from tests.support.records import fields_of

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="starting users needs root (CI)")]

# Each part's process, by its command line, and the user it runs as.
ROLES = {"redis-server": "iq-redis", "gunicorn": "iq-api", "workers.main worker": "iq-worker",
         "deliverer.main worker": "iq-deliverer", "tasks.cli flower": "iq-flower"}
APPLICATION = ("iq-api", "iq-worker", "iq-deliverer", "iq-flower")


@pytest.fixture(scope="module")
def users() -> None:
    """The users, made as an operator makes them (twice: the second run changes nothing)."""
    for _ in range(2):
        made = subprocess.run(["make", "users"], cwd=ROOT, capture_output=True, text=True,
                              timeout=600)
        assert made.returncode == 0, made.stdout + made.stderr
    assert "exist already" in made.stdout


@pytest.fixture
def open_dir():
    """A folder of the test's own that every user may enter (root's, 0755)."""
    path = Path(tempfile.mkdtemp(prefix="iq-run-users-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_user(user: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", "--reuid", user, "--regid", user, "--init-groups",
                           *argv], capture_output=True, text=True, timeout=30)


def _reachable_python(scratch: Path) -> list[str]:
    """The mount commands that let the parts' users run this Python (none where they can):
    the first folder on its way they may not enter becomes, in make run's own mount
    namespace, a 0711 one holding only the Python's folder."""
    python = Path(os.path.realpath(ROOT / ".venv" / "bin" / "python"))
    blocked = next((p for p in reversed(python.parents)
                    if as_user("iq-api", "test", "-x", str(p)).returncode), None)
    if blocked is None:
        return []
    inside = blocked / python.relative_to(blocked).parts[0]
    bound = tempfile.mkdtemp(dir=scratch, prefix="bound-python-")
    return [f"mount --bind '{inside}' '{bound}'",
            f"mount -t tmpfs -o mode=0711 tmpfs '{blocked}'",
            f"mkdir '{inside}'", f"mount --bind '{bound}' '{inside}'"]


def namespaced(scratch: Path, *mounts: str, command: list[str] = RUN) -> list[str]:
    """make run (scripts/run.sh), or `command`, in a mount namespace of its own, after
    `mounts`."""
    script = "; ".join(["set -e", *_reachable_python(scratch), *mounts, 'exec "$@"'])
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "make-run",
            *command]


def make_reload(scratch: Path, env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    """`make reload` beside make run, as root: its models check runs as the worker's user,
    so in a namespace where that user may run this Python too (`namespaced`)."""
    return subprocess.run(namespaced(scratch, command=[".venv/bin/python", "-m",
                                                       "scripts.reload", *argv]),
                          cwd=ROOT, env=env, text=True, capture_output=True, timeout=180)


def synthetic_models(path: Path, base_ms: int) -> Path:
    path.write_text(yaml.safe_dump({"models": {"synthetic": {
        "kind": "synthetic", "base_ms": base_ms, "per_item_ms": 0, "max_batch_size": 1}}}))
    path.chmod(0o644)
    return path


# A kinds module (config/kinds.py) that records who imports it, each time it is imported:
# its process's uid and argv, a JSON line each, in KINDS_RECORD_FILE. It registers a kind
# of its own, `recorded` (the synthetic kind under another name).
RECORDING_KINDS = """import dataclasses, json, os, sys
from config.kinds import kind_of, register
with open(os.environ["KINDS_RECORD_FILE"], "a") as out:
    out.write(json.dumps({"uid": os.getuid(), "argv": sys.argv}) + "\\n")
register(dataclasses.replace(kind_of("synthetic"), name="recorded"))
"""


def recording_kinds(folder: Path, env: dict[str, str], *modules: str) -> Path:
    """`iqrecorded` (RECORDING_KINDS) where `env`'s processes import it (PYTHONPATH), and a
    models file naming it and `modules`, its one model of kind `recorded`; the record file
    every user may append to."""
    lib = folder / "pylib"
    lib.mkdir(mode=0o755, exist_ok=True)
    (lib / "iqrecorded.py").write_text(RECORDING_KINDS)
    (lib / "iqrecorded.py").chmod(0o644)
    record = folder / "kinds-record.jsonl"
    record.touch()
    record.chmod(0o666)
    env.update(PYTHONPATH=str(lib), KINDS_RECORD_FILE=str(record))
    models = folder / "models-recorded.yaml"
    models.write_text(yaml.safe_dump({"kinds": ["iqrecorded", *modules], "models": {
        "synthetic": {"kind": "recorded", "base_ms": 5, "per_item_ms": 0,
                      "max_batch_size": 1}}}))
    models.chmod(0o644)
    return models


def _submit(api: str, text: str) -> str:
    r = requests.post(f"{api}/v1/jobs", json={"model": "synthetic", "inputs": [text]},
                      timeout=10)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def _status(api: str, job_id: str) -> str:
    return requests.get(f"{api}/v1/jobs/{job_id}", timeout=10).json()["status"]


def _parts(run: MakeRun) -> dict[str, list]:
    """Each role's processes (the part itself and what it started), by ROLES."""
    found: dict[str, list] = {}
    for proc in run.processes():
        cmd = " ".join(proc.cmdline())
        role = next((r for r in ROLES if r in cmd), None)
        if role and "scripts.respawn" not in cmd:  # a keeper: root's
            found.setdefault(role, []).append(proc)
    return found


def check_each_part_is_its_user_and_walled_off(run: MakeRun, env: dict[str, str]) -> None:
    parts = _parts(run)
    assert set(parts) == set(ROLES), parts
    for role, procs in parts.items():
        for proc in procs:
            assert set(proc.uids()) == {int(as_user(ROLES[role], "id", "-u").stdout)}, role
    for proc in run.processes():
        cmd = proc.cmdline()
        if "scripts.respawn" in cmd:
            assert set(proc.uids()) == {0}  # the keepers stay root, to stop and restart parts
            # What each part starts (the worker's pool children, Flower's shell) is its user's.
            uid = int(as_user(cmd[cmd.index("--user") + 1], "id", "-u").stdout)
            assert {tuple(child.uids()) for child in proc.children(recursive=True)} == \
                {(uid, uid, uid)}, cmd
    var = Path(env["IQ_VAR_DIR"])
    kept = var / "secrets-redis"
    assert as_user("iq-redis", "cat", str(kept / "redis-password")).stdout.strip() == \
        secret(env, "redis-password")
    for user in APPLICATION:
        for name in ("redis-password", "redis-app-password"):
            for path in (kept / name, var / "secrets" / name):
                assert as_user(user, "cat", str(path)).returncode != 0, (user, path)
    # Each user reads its own part's environment (the probe works) and no other part's.
    for role, procs in parts.items():
        if role == "redis-server":
            continue  # it writes its process title over its environment
        environ = f"/proc/{procs[0].pid}/environ"
        for user in set(ROLES.values()):
            readable = as_user(user, "cat", environ).returncode == 0
            assert readable == (user == ROLES[role]), (user, role)


def test_each_part_runs_as_its_own_user_serves_reloads_and_stops_in_order(users, open_dir):
    models = synthetic_models(open_dir / "models.yaml", 5)
    env = run_env(open_dir, IQ_RUN_USERS="separate", IQ_MODELS_FILE=str(models))
    api = f"http://127.0.0.1:{env['IQ_PORT']}"
    first = MakeRun(env, open_dir / "first.log", command=namespaced(open_dir))
    try:
        first.wait_up(300)
        job = _submit(api, "abc")
        wait_until(lambda: _status(api, job) == "succeeded", 60, "the job answered")
        check_each_part_is_its_user_and_walled_off(first, env)

        # `make reload` beside it, as root, of a changed models file.
        changed = synthetic_models(open_dir / "models-changed.yaml", 300)
        reloaded = make_reload(open_dir, env, str(changed), "--timeout", "120")
        assert reloaded.returncode == 0, reloaded.stdout + reloaded.stderr
        assert "reload done" in reloaded.stdout

        # Ctrl-C with jobs running and queued (300 ms each, one at a time).
        jobs = [_submit(api, f"job {i}") for i in range(6)]
        wait_until(lambda: _status(api, jobs[0]) == "succeeded", 60, "a first job done")
    finally:
        first.stop(signal.SIGINT)
        left, busy = first.left_behind(), first.ports_in_use()
        first.reap()
    assert left == [] and busy == []
    assert "in order, nothing killed" in first.output(), first.output()[-3000:]

    # Started again on the data Redis's user now owns: every job runs once.
    second = MakeRun(env, open_dir / "second.log", command=namespaced(open_dir))
    try:
        second.wait_up(300)
        wait_until(lambda: all(_status(api, j) == "succeeded" for j in jobs), 120,
                   "every job answered after the restart")
        client = redis.Redis(port=int(env["REDIS_PORT"]), username="iq",
                             password=secret(env, "redis-app-password"), decode_responses=True)
        runs = {j: record.get("runs") for j, record in fields_of(client, jobs).items()}
        assert runs == {j: "1" for j in jobs}
    finally:
        second.stop(signal.SIGINT)
        left, busy = second.left_behind(), second.ports_in_use()
        second.reap()
    assert left == [] and busy == []


@pytest.mark.parametrize("case", ["not root", "missing user", "unreadable models file",
                                  "var folder others cannot enter"])
def test_a_start_the_users_cannot_serve_is_refused_in_one_line_nothing_started(
        users, open_dir, tmp_path, case):
    models = synthetic_models(open_dir / "models.yaml", 5)
    env = run_env(open_dir, IQ_RUN_USERS="separate", IQ_MODELS_FILE=str(models))
    mounts: list[str] = []
    api_uid = int(as_user("iq-api", "id", "-u").stdout)
    if case == "not root":  # as an operator who forgot sudo: make run as a user of its own
        command = namespaced(open_dir)
        command[command.index(RUN[0]):] = ["setpriv", "--reuid", "iq-api", "--regid",
                                           "iq-api", "--init-groups", *RUN]
        expected = [f"make run: IQ_RUN_USERS=separate starts each part as a user of its own, "
                    f"which only root may do, and you are uid {api_uid}: run it as root, or "
                    "set IQ_RUN_USERS=one"]
    else:
        if case == "missing user":  # its /etc/passwd without iq-worker
            passwd = open_dir / "passwd"
            passwd.write_text("".join(line for line in open("/etc/passwd")
                                      if not line.startswith("iq-worker:")))
            mounts = [f"mount --bind '{passwd}' /etc/passwd"]
            expected = ["make run: IQ_RUN_USERS=separate: no user iq-worker on this host: "
                        "create the users with `make users` (as root), or set "
                        "IQ_RUN_USERS=one"]
        elif case == "unreadable models file":
            models.chmod(0o600)
            expected = [f"make run: IQ_RUN_USERS=separate: iq-api, iq-worker, iq-flower, "
                        f"iq-deliverer cannot read IQ_MODELS_FILE {models} (mode 0600, owner "
                        "root): make it readable by them, or set IQ_RUN_USERS=one"]
        else:  # pytest's own folders are root's alone (0700)
            env["IQ_VAR_DIR"] = str(tmp_path / "var")
            shut = next(p for p in (*reversed(tmp_path.parents), tmp_path)
                        if not p.stat().st_mode & 0o001)  # /tmp/pytest-of-root
            expected = [f"make run: IQ_RUN_USERS=separate: iq-redis, iq-api, iq-worker, "
                        f"iq-flower, iq-deliverer cannot reach IQ_VAR_DIR {tmp_path / 'var'}: "
                        f"{shut} is mode 0700, owner root; let them through (chmod o+x "
                        f"'{shut}') or move it, or set IQ_RUN_USERS=one"]
        command = namespaced(open_dir, *mounts)
    done = start_refused(command, env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.splitlines() == expected
    assert not Path(env["IQ_VAR_DIR"]).exists()  # nothing made, nothing started
    assert all(bind_error("127.0.0.1", int(env[name])) is None for name in PORTS)


def _reports(client: redis.Redis) -> dict[str, dict]:
    return {name: orjson.loads(raw) for name, raw in client.hgetall(RELOAD_STATUS_KEY).items()}


def _announce(client: redis.Redis, revision: str) -> None:
    """As make reload announces a revision (scripts/reload.py), without its check."""
    with client.pipeline() as pipe:
        pipe.incr(MODELS_ANNOUNCEMENTS_KEY)
        pipe.set(MODELS_REVISION_KEY, revision)
        pipe.execute()


def _app_client(env: dict[str, str]) -> redis.Redis:
    return redis.Redis(port=int(env["REDIS_PORT"]), username="iq",
                       password=secret(env, "redis-app-password"), decode_responses=True)


def test_a_models_file_the_parts_cannot_read_is_refused_by_reload_and_held_by_the_keepers(
        users, open_dir):
    """Root reads what the parts' users may not: a models file made root's alone (0600) is
    refused by `make reload`, nothing changed; announced anyway (a chmod after the check), the
    worker refuses it and keeps consuming (its unreadable file used to be taken for a lost
    broker connection: the consumer restarted every 3 s, for ever); and a part started again
    meanwhile is held by its keeper, saying why once, checked as the part's user (the check as
    root passed, and the API's gunicorn was started again every 30 s, each time failing)."""
    models = synthetic_models(open_dir / "models.yaml", 20)
    env = run_env(open_dir, IQ_RUN_USERS="separate", IQ_MODELS_FILE=str(models))
    api = f"http://127.0.0.1:{env['IQ_PORT']}"
    run = MakeRun(env, open_dir / "run.log", command=namespaced(open_dir))
    load = None
    try:
        run.wait_up(300)
        client = _app_client(env)
        load = Load(api, "synthetic", "load", clients=2, pause_s=0.2).start()
        wait_until(lambda: len(load.accepted) > 10, 60, "the load to run")
        good, announced = models.read_bytes(), client.get(MODELS_REVISION_KEY)
        synthetic_models(models, 30).chmod(0o600)
        refused = make_reload(open_dir, env, "--timeout", "60")
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert refused.stdout.splitlines()[-1] == (
            "reload refused, nothing changed: make reload: IQ_RUN_USERS=separate: iq-api, "
            f"iq-worker, iq-deliverer, iq-flower cannot read IQ_MODELS_FILE {models} (mode "
            "0600, owner root): make it readable by them, and make reload again; nothing "
            "changed"), refused.stdout
        assert client.get(MODELS_REVISION_KEY) == announced

        logged = len(run.output())
        _announce(client, revision_of(models.read_bytes()))
        wait_until(lambda: {n.split(":")[0]: r["state"] for n, r in _reports(client).items()}
                   .get("worker") == "refused", 60, "the worker to refuse it")
        error = next(r["error"] for n, r in _reports(client).items() if n.startswith("worker"))
        assert f"models file {models}: cannot read it: Permission denied" in error, error
        served = len(load.accepted)
        wait_until(lambda: len(load.accepted) > served + 20, 60, "more jobs, a few seconds on")
        assert "Connection to broker lost" not in run.output()[logged:]
        load.stop()

        # The API stopped (a crash, a kill) while its user cannot read the file.
        logged = len(run.output())
        master = next(p for p in _parts(run)["gunicorn"]
                      if "gunicorn" not in " ".join(p.parent().cmdline()))
        master.kill()
        held = wait_until(lambda: next((line for line in run.output()[logged:].splitlines()
                                        if "web exited" in line), None), 60, "its keeper's word")
        assert "it is not started again while its configuration fails make run's check: " \
               f"models file {models}: cannot read it: Permission denied" in held, held
        models.write_bytes(good)
        models.chmod(0o644)
        _announce(client, revision_of(good))
        wait_until(lambda: "web: its configuration passes the check again; starting it" in
                   run.output()[logged:], 60, "the API started again")
        wait_until(lambda: requests.get(f"{api}/readyz", timeout=5).ok, 120, "the API back")
        exits = [line for line in run.output()[logged:].splitlines() if "web exited" in line]
        # Held once, then started once it passed: never started only to fail.
        assert [("not started again" in x, "starting it again in" in x) for x in exits] == \
            [(True, False), (False, True)], exits
        jobs = list(load.accepted.values())
        wait_until(lambda: {r["status"] for r in fields_of(client, jobs).values()} ==
                   {"succeeded"}, 120, "every job answered")
        assert {r.get("runs") for r in fields_of(client, jobs).values()} == {"1"}
        assert load.gave_up == []
    finally:
        if load is not None:
            load.stop()
        run.stop(signal.SIGINT)
        left, busy = run.left_behind(), run.ports_in_use()
        run.reap()
    assert left == [] and busy == []


def test_switching_between_one_and_separate_on_one_var_folder_keeps_redis_serving(
        users, open_dir):
    """separate, then one (as root), then separate again on the same var folder: what root's
    Redis wrote in the folder Redis's user owns (an append-only file rewritten as it grows,
    auto-aof-rewrite, here asked for at once) is handed back to that user; it used to stay
    root's, and Redis's user could not open it: Redis started again every 30 s, for ever."""
    models = synthetic_models(open_dir / "models.yaml", 5)
    env = run_env(open_dir, IQ_RUN_USERS="separate", IQ_MODELS_FILE=str(models))
    api = f"http://127.0.0.1:{env['IQ_PORT']}"
    data = Path(env["IQ_VAR_DIR"]) / "redis"
    jobs: list[str] = []
    for turn, mode in enumerate(("separate", "one", "separate")):
        run = MakeRun({**env, "IQ_RUN_USERS": mode}, open_dir / f"run-{turn}.log",
                      command=namespaced(open_dir))
        try:
            run.wait_up(120)  # Redis that cannot open its file: never up
            jobs.append(_submit(api, f"turn {turn}"))
            wait_until(lambda: all(_status(api, j) == "succeeded" for j in jobs), 60,
                       "every job so far answered")
            runs = {j: r.get("runs") for j, r in fields_of(_app_client(env), jobs).items()}
            assert runs == {j: "1" for j in jobs}
            if mode == "one":
                admin = redis.Redis(port=int(env["REDIS_PORT"]),
                                    password=secret(env, "redis-password"))
                admin.bgrewriteaof()
                wait_until(lambda: not admin.info("persistence")["aof_rewrite_in_progress"]
                           and any(p.stat().st_uid == 0 for p in data.iterdir()), 60,
                           "root's Redis to rewrite its file")
        finally:
            run.stop(signal.SIGINT)
            left, busy = run.left_behind(), run.ports_in_use()
            run.reap()
        assert left == [] and busy == []
    redis_uid = int(as_user("iq-redis", "id", "-u").stdout)
    assert {p.stat().st_uid for p in data.rglob("*")} == {redis_uid}

# The var folder as make run as root leaves it: with one user, and with separate ones.
@pytest.mark.parametrize("var_mode", [0o700, 0o711])
def test_make_run_as_another_user_on_a_var_folder_root_made_is_refused_in_one_line(
        users, open_dir, var_mode):
    """make run as a user of its own (IQ_RUN_USERS=one) on the var folder an earlier make run
    as root made (root's, its secrets 0700): refused in one line naming the folder, where it
    used to stop on a traceback (PermissionError) reading a secret it may not."""
    var = open_dir / "var"
    kept_secret(var, "redis-password")
    var.chmod(var_mode)
    env = run_env(open_dir, IQ_RUN_USERS="one", IQ_MODELS_FILE=str(
        synthetic_models(open_dir / "models.yaml", 5)))
    command = namespaced(open_dir)
    command[command.index(RUN[0]):] = ["setpriv", "--reuid", "iq-api", "--regid", "iq-api",
                                       "--init-groups", *RUN]
    refused = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
    api_uid = int(as_user("iq-api", "id", "-u").stdout)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refused.stderr.splitlines() == [
        f"make run: {var} is owned by uid 0, not by you (uid {api_uid}): another user may "
        "have made it (choosing the secrets or the data in it) or may read it. Delete it, or "
        "move IQ_VAR_DIR to a folder only you can write, and make run makes a new one."]
    assert all(bind_error("127.0.0.1", int(env[name])) is None for name in PORTS)


def test_a_kinds_module_is_imported_only_by_the_parts_that_serve_models_never_as_root(
        users, open_dir):
    """A models file's `kinds:` modules are code: with separate, make run's and make reload's
    checks import them as the worker's user (they were imported as root), the API and the
    worker as their own, and the deliverer and Flower (which hold the webhook secret and
    Flower's login, and only route by name and queue) not at all. A module that does not
    import is refused in one line by make reload, nothing changed, and by make run, nothing
    started."""
    env = run_env(open_dir, IQ_RUN_USERS="separate")
    models = recording_kinds(open_dir, env)
    env["IQ_MODELS_FILE"] = str(models)
    record = Path(env["KINDS_RECORD_FILE"])
    uid = {user: int(as_user(user, "id", "-u").stdout) for user in APPLICATION}
    api = f"http://127.0.0.1:{env['IQ_PORT']}"
    run = MakeRun(env, open_dir / "run.log", command=namespaced(open_dir))
    try:
        run.wait_up(300)
        job = _submit(api, "abc")
        wait_until(lambda: _status(api, job) == "succeeded", 60, "the job answered")
        # Up means Flower and the deliverer answer too (wait_up), on a file of a kind they
        # do not import.
        changed = models.read_text().replace("base_ms: 5", "base_ms: 6")
        models.write_text(changed)
        reloaded = make_reload(open_dir, env, "--timeout", "120")
        assert reloaded.returncode == 0, reloaded.stdout + reloaded.stderr
        after = _submit(api, "def")
        wait_until(lambda: _status(api, after) == "succeeded", 60, "a job after the reload")

        # A kinds module that does not import: make reload refuses it, nothing changed.
        client = _app_client(env)
        announced = client.get(MODELS_REVISION_KEY)
        models.write_text(changed.replace("- iqrecorded", "- iqrecorded\n- iq_no_such_kinds"))
        refused = make_reload(open_dir, env, "--timeout", "60")
        assert refused.returncode == 1, refused.stdout + refused.stderr
        missing = (f"{models}: kinds: cannot import module 'iq_no_such_kinds': "
                   "ModuleNotFoundError: No module named 'iq_no_such_kinds'")
        assert refused.stdout.splitlines() == [f"reload refused, nothing changed: {missing}"]
        assert client.get(MODELS_REVISION_KEY) == announced
    finally:
        run.stop(signal.SIGINT)
        left, busy = run.left_behind(), run.ports_in_use()
        run.reap()
    assert left == [] and busy == []

    records = [orjson.loads(line) for line in record.read_text().splitlines()]
    by_uid: dict[int, list] = {}
    for line in records:
        by_uid.setdefault(line["uid"], []).append(" ".join(line["argv"]))
    assert 0 not in by_uid, by_uid[0]
    assert uid["iq-deliverer"] not in by_uid and uid["iq-flower"] not in by_uid, by_uid
    # Imported where models are served and described, and by the checks, as the worker.
    assert {uid["iq-api"], uid["iq-worker"]} == set(by_uid), by_uid
    assert any("models_as_user" in argv for argv in by_uid[uid["iq-worker"]]), by_uid

    # make run refuses it in one line, nothing started.
    shutil.rmtree(env["IQ_VAR_DIR"])
    started = subprocess.run(namespaced(open_dir), cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120, start_new_session=True)
    assert started.returncode == 1, started.stdout + started.stderr
    assert started.stderr.splitlines() == [f"make run: {missing}"]
    assert not Path(env["IQ_VAR_DIR"]).exists()
    assert all(bind_error("127.0.0.1", int(env[name])) is None for name in PORTS)
    assert 0 not in {orjson.loads(line)["uid"] for line in record.read_text().splitlines()}
