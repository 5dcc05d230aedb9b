"""The Lua scripts the project runs inside Redis, one file each in tasks/lua/ (an editor, a
linter and a reader find each in one place), read once, when the module that runs it is
imported; that module registers the text with redis-py (`register_script`), whose SHA is the
text's as composed here.

`script(name, constants)` is the text of tasks/lua/<name>.lua with

* each `-- #include <fragment>` line replaced by tasks/lua/<fragment>.lua (itself expanded the
  same way): the shared parts a script is built on (a job script's prelude, say) are named in
  the script, where they go;
* before it, `local NAME = <value>` for each of `constants` (a Python name -> str, int, float
  or a sequence of them, as a Lua table) that the text uses: the key prefixes and field names
  the Python side defines, given to the Lua side in one place, by name;
* its comment lines and blank lines left out: they are for the reader of the file, and a
  submit that waits for replicas sends its script whole (EVAL), every time.

A fragment is a file no Python module names: only scripts include it.

Another folder of scripts (`folder`: the worker's, workers/broker/lua/) is read the same way;
an include its folder lacks is one of tasks/lua/'s shared fragments."""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Mapping

FOLDER = Path(__file__).with_name("lua")
_INCLUDE = re.compile(r"^-- #include ([\w-]+)[ \t]*$", re.M)


@functools.cache
def source(name: str, folder: Path | None = None) -> str:
    """tasks/lua/<name>.lua (or `folder`'s) as it is on disk, read once."""
    path = (folder or FOLDER) / f"{name}.lua"
    try:
        return path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"no Lua script {name!r}: {path} is missing") from None


def script(name: str, constants: Mapping[str, Any] | None = None,
           folder: Path | None = None) -> str:
    """The text to run: the script, its fragments included, after the constants it uses."""
    body = "".join(line for line in _expand(name, (), folder).splitlines(keepends=True)
                   if line.strip() and not line.lstrip().startswith("--"))
    header = "".join(f"local {key} = {literal(value)}\n"
                     for key, value in (constants or {}).items()
                     if re.search(rf"\b{re.escape(key)}\b", body))
    return header + body


def includes(name: str, folder: Path | None = None) -> list[str]:
    """The fragments a file names in its `-- #include` lines (not theirs), in order."""
    return _INCLUDE.findall(source(name, folder))


def _expand(name: str, chain: tuple[str, ...], folder: Path | None = None) -> str:
    if name in chain:
        raise ValueError(f"{folder or 'tasks/lua'}/{name}.lua includes itself: "
                         f"{' -> '.join((*chain, name))}")
    if folder is not None and chain and not (folder / f"{name}.lua").exists():
        folder = None  # one of tasks/lua/'s shared fragments
    return _INCLUDE.sub(lambda m: _expand(m.group(1), (*chain, name), folder),
                        source(name, folder))


def literal(value: Any) -> str:
    """`value` as a Lua literal: a string (every byte not printable ASCII escaped, `\\ddd`), a
    number, or a table of them (a list or tuple)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return "'" + "".join(chr(b) if 32 <= b < 127 and b not in (39, 92) else f"\\{b}"
                             for b in value.encode()) + "'"
    if isinstance(value, (list, tuple)):
        return "{" + ", ".join(literal(item) for item in value) + "}"
    raise TypeError(f"no Lua literal for {type(value).__name__} {value!r}")
