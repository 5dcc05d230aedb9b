"""Before `make run` starts anything: is every port it will bind free, and are the model files it
will load the operator's alone?

A taken port stops it with one message per port that names the port, what holds it when that
can be told (a Redis that answers PING, an HTTP server), and the variable to set. A models file,
model file or folder (or anything in it) that another user may write stops it too, naming the
file: models are code (TorchScript and torch.export programs run in the worker as they were
written; docs/security.md), so whoever may write one may run code as the worker's user. Who may
replace a file is decided by every folder above it, up to /, and by each link on the way (its
owner, and where it points); who may write it, by its mode and its POSIX ACL. The settings file
(IQ_CONFIG) and the API keys file are checked the same way (`operator_file_problems`)."""
from __future__ import annotations

import errno
import grp
import importlib.machinery
import os
import pwd
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple

# The Redis user the application's processes connect as, in a Redis make run (or the tests'
# stack) starts: scripts/redis-server.sh gives it every command but the administrative ones.
REDIS_APP_USER = "iq"


class Refused(Exception):
    """A setting make run cannot start with; the message says which and why."""


@dataclass(frozen=True)
class Binding:
    what: str      # what make run would serve there: "Redis", "the API"
    variable: str  # the variable that moves it: "REDIS_PORT"
    host: str
    port: int


def reachable(host: str) -> str:
    """The address a client on this machine uses for a server bound to `host`."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not bind host:port now, or None. SO_REUSEADDR as the servers set it,
    so that connections still in TIME_WAIT from an earlier run do not count as taken."""
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:
        return exc
    return None


def _ask(host: str, port: int, request: bytes) -> bytes:
    try:
        with socket.create_connection((host, port), timeout=1) as sock:
            sock.sendall(request)
            return sock.recv(4096)
    except OSError:
        return b""


class Holder(NamedTuple):
    """What listens on a port, as far as two harmless requests can tell."""
    description: str
    redis_auth: str | None = None  # a Redis: the userinfo part of a URL that reaches it


def holder(host: str, port: int, redis_password: str | None = None,
           password_shown: str = "") -> Holder:
    """Asks PING (a Redis answers +PONG, or -NOAUTH when it wants a password), then HEAD / (an
    HTTP server answers with a status line and, often, its name)."""
    host = reachable(host)
    reply = _ask(host, port, b"PING\r\n")
    if reply.startswith(b"+PONG"):
        return Holder("a Redis server that answers PING without a password", "")
    if reply.startswith(b"-NOAUTH"):
        if redis_password and _ask(host, port, f"AUTH {redis_password}\r\n".encode()) \
                .startswith(b"+OK"):
            return Holder("this project's own Redis, from another `make run` (one still "
                          "running, or left behind by one that was killed)",
                          f":$(cat {password_shown})@")
        return Holder("a Redis server that requires a password", ":PASSWORD@")
    head = _ask(host, port, f"HEAD / HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
    if head.startswith(b"HTTP/"):
        server = next((line.split(b":", 1)[1].strip().decode(errors="replace")
                       for line in head.split(b"\r\n") if line.lower().startswith(b"server:")),
                      "")
        return Holder(f"an HTTP server ({server})" if server else "an HTTP server")
    return Holder("a program that answers neither as Redis nor as HTTP")


def _free_port_after(binding: Binding, taken: set[int]) -> int | None:
    for port in range(binding.port + 1, min(binding.port + 200, 65536)):
        if port not in taken and bind_error(binding.host, port) is None:
            return port
    return None


def _advice(binding: Binding, held_by: Holder, taken: set[int]) -> str:
    lines = [f"make run: port {binding.port} for {binding.what} ({binding.variable}) is in use "
             f"by {held_by.description}."]
    move = "Move it to a free port:"
    if binding.variable == "REDIS_PORT" and held_by.redis_auth is not None:
        url = f"redis://{held_by.redis_auth}{reachable(binding.host)}:{binding.port}/0"
        lines.append(f"  Use that Redis:            REDIS_URL={url} make run")
        move = "Or move it to a free port:"
    free = _free_port_after(binding, taken)
    lines.append(f"  {move:<26} {binding.variable}={free or '<a free port>'} make run")
    return "\n".join(lines)


def port_problems(bindings: list[Binding], redis_password: str | None = None,
                  password_shown: str = "") -> list[str]:
    """One message per port that cannot be bound (none: all free). A Redis that accepts
    `redis_password` (kept in the file `password_shown`) is told apart as this project's own."""
    problems = []
    by_port: dict[int, Binding] = {}
    for binding in bindings:
        if binding.port in by_port:
            problems.append(f"make run: {by_port[binding.port].variable} and {binding.variable} "
                            f"are both {binding.port}: give each its own port.")
        by_port[binding.port] = binding
    for binding in bindings:
        error = bind_error(binding.host, binding.port)
        if error is None:
            continue
        if error.errno == errno.EADDRINUSE:
            held_by = holder(binding.host, binding.port, redis_password, password_shown)
            problems.append(_advice(binding, held_by, set(by_port)))
        else:
            problems.append(f"make run: cannot bind {binding.host}:{binding.port} for "
                            f"{binding.what} ({error}); check {binding.variable}.")
    return problems


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"'{grp.getgrgid(gid).gr_name}'"
    except KeyError:
        return f"gid {gid}"


def _others_in_group(gid: int, owner_uid: int) -> bool:
    """Whether a user other than the owner is in group `gid` (a user private group, as
    Debian and Ubuntu give each user, has none)."""
    try:
        members = set(grp.getgrgid(gid).gr_mem)
    except KeyError:
        return True
    members |= {user.pw_name for user in pwd.getpwall() if user.pw_gid == gid}
    try:
        members.discard(pwd.getpwuid(owner_uid).pw_name)
    except KeyError:
        pass
    return bool(members)


def writable_entry(path: Path) -> str | None:
    """Why another user may change `path` itself, or None: not what decides it (the folders
    above, where a link points: `writable_by_others` walks those)."""
    info = path.lstat()
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISLNK(info.st_mode):
        # A link's own mode means nothing, but its owner may point it anywhere: in a sticky
        # folder (/tmp) another user may plant one under a name this user's tools open. Where
        # it points is a step of its own (`guarding`).
        if info.st_uid not in (0, os.getuid()):
            return f"is a link owned by another user, {_owner(info.st_uid)}"
        return None
    if info.st_uid not in (0, os.getuid()):
        return f"is owned by another user, {_owner(info.st_uid)}"
    if stat.S_ISDIR(info.st_mode) and mode & stat.S_ISVTX:
        return None  # sticky (/tmp): others may not replace what is not theirs
    if mode & 0o002:
        return f"is writable by everyone (mode {mode:04o})"
    if mode & 0o020 and _others_in_group(info.st_gid, info.st_uid):
        return f"is writable by group {_group(info.st_gid)}, which has other users " \
               f"(mode {mode:04o})"
    return _acl_writers(path, info.st_uid)


def writable_by_others(path: Path) -> str | None:
    """Why another user may change what `path` is or holds, or None: `path` itself, each link
    on the way (its owner, then where it points, one hop at a time) and every folder above
    each, up to / (`guarding`), as the models file's check does. The reason names the step
    at fault when it is not `path` itself ("/srv is writable by everyone (mode 0777)"); a
    step that does not exist is passed over (reading the file says so)."""
    path = Path(os.path.abspath(path))
    for step in guarding(path, set()):
        try:
            why = writable_entry(step)
        except FileNotFoundError:
            continue
        if why:
            return why if step == path else f"{step} {why}"
    return None


# A POSIX ACL as Linux keeps it in the system.posix_acl_access attribute (acl_ea.h): a version,
# then (tag, permissions, id) entries. Named users' and groups' rights are cut by the mask.
_ACL_USER, _ACL_GROUP_OBJ, _ACL_GROUP, _ACL_MASK, _ACL_WRITE = 0x02, 0x04, 0x08, 0x10, 0o2


def _acl_writers(path: Path, owner_uid: int) -> str | None:
    """Why the file's POSIX ACL lets another user write it, or None (no ACL: the mode says
    all, and `ls -l` shows a `+`)."""
    try:
        raw = os.getxattr(path, "system.posix_acl_access", follow_symlinks=False)
    except OSError:
        return None  # no ACL, or a file system without them
    entries = [struct.unpack_from("<HHI", raw, offset) for offset in range(4, len(raw), 8)]
    mask = next((perm for tag, perm, _id in entries if tag == _ACL_MASK), 0o7)
    for tag, perm, who in entries:
        if not perm & mask & _ACL_WRITE:
            continue
        if tag == _ACL_USER and who not in (0, owner_uid):
            return f"lets {_owner(who)} write it through its ACL (getfacl '{path}')"
        if tag in (_ACL_GROUP, _ACL_GROUP_OBJ) and (
                tag == _ACL_GROUP or _others_in_group(path.lstat().st_gid, owner_uid)):
            return f"lets a group write it through its ACL (getfacl '{path}')"
    return None


def guarding(path: Path, seen: set[Path]) -> Iterator[Path]:
    """`path` and everything that decides what it is: each folder above it up to /, and each
    link on the way followed one hop at a time (a chain's middle links and their folders
    decide too), with the folders above each hop. `seen` ends a loop of links."""
    for step in (path, *path.parents):
        if step in seen:
            continue
        seen.add(step)
        yield step
        if step.is_symlink():
            hop = os.path.join(os.path.realpath(step.parent), os.readlink(step))
            yield from guarding(Path(os.path.normpath(hop)), seen)


def _inside(folder: Path) -> Iterator[Path]:
    """Everything in `folder`, through linked folders too (each real folder once)."""
    walked: set[str] = set()
    for here, folders, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(here)
        if real in walked:
            folders.clear()
            continue
        walked.add(real)
        for name in folders + files:
            yield Path(here) / name


def _model_paths(models_file: Path) -> Iterator[Path]:
    """The models file, each model's file or folder and everything in it, and whatever
    decides what each of those is (guarding)."""
    seen: set[Path] = set()
    yield from guarding(Path(os.path.abspath(models_file)), seen)
    for root in model_roots(models_file):
        yield from guarding(root, seen)
        if root.is_dir():
            for inner in _inside(root):
                yield from guarding(inner, seen)


def package_folder(name: str) -> Path | None:
    """The folder of the package `name` ("a.b.c") as the import system would find it on
    sys.path, found without importing it or its parents: these checks may run as root
    (IQ_RUN_USERS=separate), and a package's `__init__` is code its author wrote.
    `importlib.util.find_spec("a.b")` would import `a`."""
    locations: list[str] | None = None
    for part in name.split("."):
        found = importlib.machinery.PathFinder.find_spec(part, locations)
        if found is None or not found.submodule_search_locations:
            return None
        locations = list(found.submodule_search_locations)
    return Path(locations[0]) if locations else None


def model_roots(models_file: Path) -> Iterator[Path]:
    """Each declared model's file or folder, as the worker will open it."""
    from config import load_models

    for spec in load_models(models_file).values():
        if spec.path:
            root = Path(spec.path)
        elif spec.package:
            root = package_folder(spec.package)
            if root is None:
                continue  # the worker says so when it loads it
        else:
            continue
        if root.exists():
            yield root


def model_file_problems(models_file: str) -> list[str]:
    """One message per model file or folder another user may write (none: all private)."""
    problems = []
    for path in _model_paths(Path(models_file)):
        why = writable_entry(path)
        if why:
            problems.append(
                f"make run: {path} {why}. A model file is code the worker runs, so only you "
                f"(or root) may write it: chmod go-w '{path}' (or chown it to yourself).")
    return problems


# The operator's files beside the models file, by the variable that names each, and what
# another user who may change one takes: checked as the models file is.
OPERATOR_FILES = {
    "IQ_CONFIG": "every process's settings (where Redis is, the webhook secret, which models "
                 "file) come from it",
    "IQ_API_KEYS_FILE": "it says which keys may use the API, and which models each reaches",
}


def operator_file_problems(settings_file: str, api_keys_file: str) -> list[str]:
    """One line per operator file that another user may change (none: all private), naming
    the variable, the file and why: the settings file (IQ_CONFIG) and the API keys file
    (IQ_API_KEYS_FILE, or the settings file's `api_keys_file`)."""
    problems = []
    for variable, name in (("IQ_CONFIG", settings_file), ("IQ_API_KEYS_FILE", api_keys_file)):
        why = writable_by_others(Path(name)) if name else None
        if why:
            problems.append(f"{variable} {name}: {why.removeprefix('is ')}; "
                            f"{OPERATOR_FILES[variable]}, so only you (or root) may change it")
    return problems
