"""What `make run` keeps under IQ_VAR_DIR (default var/), and the check that it is this user's
alone: the secrets (var/secrets/, each made on first use, mode 0600: `kept_secret`) and Redis's
data and sentinels' state (var/redis*, var/sentinel-*). A file or folder there that another
user made, or a link to elsewhere, would let them choose or read the secrets, or a sentinel's
word on which node is the primary; so would a folder above IQ_VAR_DIR that others may write.
`var_problems` names each before anything is written (scripts/run.py), and `kept_secret`
refuses one it meets (`Refused`)."""
from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from scripts.preflight import Refused, guarding, writable_entry
from scripts.processes import ROOT


def shown(path: Path) -> str:
    """`path` as make run's messages show it: relative to the repository when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _not_ours(path: Path, info: os.stat_result, also: int | None = None) -> str | None:
    """Why `path` (lstat'ed as `info`) cannot hold this user's secrets, or None; `also`: a
    uid that may own it too (Redis's user, with IQ_RUN_USERS=separate)."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if info.st_uid not in (os.getuid(), also):
        return f"is owned by uid {info.st_uid}, not by you (uid {os.getuid()})"
    return None


def _refuse_foreign(path: Path, why: str) -> Refused:
    return Refused(f"make run: {shown(path)} {why}: another user may have made it (choosing "
                   "the secrets or the data in it) or may read it. Delete it, or move "
                   "IQ_VAR_DIR to a folder only you can write, and make run makes a new one.")


def var_problems(var_dir: Path, redis_uid: int | None = None) -> list[str]:
    """One message per folder or file under var_dir that make run would use but another user
    made (or that is a link to elsewhere): its secrets, or a sentinel's word on which node is
    the primary, would be theirs to choose or read; and one per folder above var_dir that
    another user may write (who may rename var_dir away and put theirs in its place), as the
    model files' check finds them. `redis_uid` (IQ_RUN_USERS=separate: scripts/run_users.py)
    may own Redis's folders (its data, the sentinels', the copies of its password files)."""
    problems = []
    for above in guarding(Path(os.path.abspath(var_dir)).parent, set()):
        try:
            why = writable_entry(above)
        except FileNotFoundError:
            continue  # made by make run, as var_dir is
        if why:
            problems.append(f"make run: {shown(above)} {why}: another user may put a folder "
                            f"of theirs in place of {shown(var_dir)} (and so choose what make "
                            "run's tools read as its secrets). Move IQ_VAR_DIR to a folder only "
                            f"you can write, or: chmod go-w '{above}'.")
    try:  # var_dir itself may be a link to where the operator keeps it
        why = _not_ours(var_dir, var_dir.stat())
    except FileNotFoundError:
        return problems  # made by make run
    if why:  # nothing inside it is read: it may be closed to this user (a root's make run)
        return problems + [str(_refuse_foreign(var_dir, why))]
    redis = [var_dir / "redis", *sorted(var_dir.glob("redis-*")),
             *sorted(var_dir.glob("sentinel-*")),  # the replicas' and sentinels' (run_redis)
             var_dir / "secrets-redis"]
    owned = [(path, redis_uid if folder in redis else None)
             for folder in (var_dir / "secrets", *redis)
             for path in (folder, *_listing(folder))]
    for path, also in owned:
        try:
            why = _not_ours(path, path.lstat(), also)
        except FileNotFoundError:
            continue
        if why:
            problems.append(str(_refuse_foreign(path, why)))
    return problems


def _listing(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*")) if folder.is_dir() and not folder.is_symlink() else []


def kept_secret(var_dir: Path, name: str) -> tuple[str, Path]:
    """A random secret kept in var_dir/secrets/<name>, readable by this user only; made on
    first use, the same on every later run. A file or folder another user made is refused
    (`var_problems` says so before anything is written), as is a link."""
    path = var_dir / "secrets" / name
    for folder in (var_dir, path.parent):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        why = _not_ours(folder, folder.stat() if folder == var_dir else folder.lstat())
        if why:
            raise _refuse_foreign(folder, why)
        folder.chmod(0o700)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.write(fd, (secrets.token_urlsafe(24) + "\n").encode())
        os.lseek(fd, 0, os.SEEK_SET)
    except FileExistsError:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # ELOOP: a link
            raise _refuse_foreign(path, "is a symbolic link") from None
        why = _not_ours(path, os.fstat(fd))
        if why:
            os.close(fd)
            raise _refuse_foreign(path, why)
        os.fchmod(fd, 0o600)
    with os.fdopen(fd) as kept:
        value = kept.read().strip()
    if not value:
        raise Refused(f"make run: {shown(path)} is empty; delete it and a new one is made")
    return value, path
