"""An operator's file put in place (`make reload FILE=…`: scripts/reload.py `install`), safe from
the other local users of the host, whose links and files may sit in the same folder when it
is a sticky one (/tmp): nothing is written through a link; the new file and the copy of the
one it replaces (`<name>.previous`) are each written to a fresh file of their own (mkstemp
in the same folder), with the replaced file's mode and owner, and renamed into place; another
user's link or file under either name is refused before anything is written."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from scripts.preflight import writable_entry


def replaced_problems(target: Path, previous: Path) -> list[str]:
    """What another user may have put in place of the models file or its `.previous` (a link
    or a file of theirs), or may change: each refused by name, before anything is written.
    (The folder's own check is the staged file's: `install`'s `model_file_problems`.)"""
    problems = []
    if os.path.lexists(target):
        why = writable_entry(target)
        if why:
            problems.append(f"{target}: {why.removeprefix('is ')}; delete it, or move the "
                            "models file to a folder only you can write")
    if os.path.lexists(previous):
        why = writable_entry(previous)
        if why:
            problems.append(f"{previous}: {why.removeprefix('is ')}; delete it, and reload "
                            "again (it is where the file replaced is kept)")
    return problems


def staged_beside(target: Path, content: bytes, like: Path, private: bool = False) -> Path:
    """`content` in a new file of its own in `target`'s folder (mkstemp: a fresh random name,
    created O_EXCL|O_NOFOLLOW, so never through a link planted under a name guessed), with
    the mode (and, where this user may, the owner) of the file `like`; `private`: less
    group's and others' write (a first install, `like` the operator's FILE)."""
    info = like.stat()
    mode = stat.S_IMODE(info.st_mode) & (~0o022 if private else 0o7777)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".staged", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as staged:
            try:
                os.fchown(staged.fileno(), info.st_uid, info.st_gid)
            except PermissionError:
                pass  # another owner, or a group this user is not in: keeps its own
            os.fchmod(staged.fileno(), mode)  # after fchown, which clears set-id bits
            staged.write(content)
            staged.flush()
            os.fsync(staged.fileno())
    except BaseException:
        os.unlink(name)
        raise
    return Path(name)


def _synced(folder: Path) -> None:
    """The renames in `folder` on disk (a crash after them keeps them)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def put_in_place(staged: Path, target: Path, previous: Path, old: bytes | None) -> None:
    """`staged` (`staged_beside`) renamed to `target`; first `old` (the bytes of the file it
    replaces, None when there is none) kept as `previous`, written the same way."""
    if old is not None:
        kept = staged_beside(target, old, target)
        try:
            os.replace(kept, previous)
        finally:
            kept.unlink(missing_ok=True)
    os.replace(staged, target)
    _synced(target.parent)
