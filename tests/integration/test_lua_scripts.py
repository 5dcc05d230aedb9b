"""The Lua scripts in tasks/lua/ (and the worker's, in workers/broker/lua/) on a real Redis: every file is used (a module loads it, or a
script includes it), each compiles (SCRIPT LOAD) alone and as the modules compose it, under the
SHA of its final text; and no Python module keeps Lua of its own any more."""
from __future__ import annotations

import hashlib
import importlib
import re

import pytest
import redis

from scripts.stack import ROOT
from tasks import lua
from tasks.names import PRIORITY_SEP

PACKAGES = ("tasks", "app", "workers", "deliverer", "scripts")
# Python modules that still hold Lua, each for a reason: none.
STILL_IN_PYTHON: set[str] = set()
# Every folder of scripts tasks/lua.py reads: tasks/lua/, and the worker's fetch and recovery.
FOLDERS = (lua.FOLDER, ROOT / "workers" / "broker" / "lua")


def _sources() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): path.read_text()
            for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def _loading_modules() -> list:
    """Every module that reads a script from tasks/lua/, imported."""
    return [importlib.import_module(path.removesuffix(".py").replace("/", "."))
            for path, text in _sources().items()
            if re.search(r"^from tasks\.lua import|^from tasks import .*\blua\b", text, re.M)]


def _composed() -> dict[str, str]:
    """The texts the modules register ("module.NAME": text)."""
    return {f"{module.__name__}.{name}": value for module in _loading_modules()
            for name, value in vars(module).items()
            if isinstance(value, str) and "redis.call" in value}


@pytest.fixture
def client(redis_server):
    return redis.Redis.from_url(redis_server.extra["url"])


def test_every_lua_file_is_loaded_by_a_module_or_included_by_a_script():
    files = sorted(path.stem for folder in FOLDERS for path in folder.glob("*.lua"))
    assert len(files) >= 27, files
    named = set()
    for text in _sources().values():
        named |= set(re.findall(r"""\bscript\(\s*["']([\w-]+)["']""", text))
    included = {fragment for folder in FOLDERS for path in folder.glob("*.lua")
                for fragment in lua.includes(path.stem, folder)}
    unused = [name for name in files if name not in named | included]
    assert unused == [], f"Lua files nothing loads or includes: {unused}"
    missing = sorted((named | included) - set(files))
    assert missing == [], f"scripts named that no folder has: {missing}"
    # A fragment (a name starting with _) is only included; a script is loaded, never included.
    assert {name for name in included if not name.startswith("_")} == set()


def test_each_file_compiles_on_redis(client):
    for path in sorted(path for folder in FOLDERS for path in folder.glob("*.lua")):
        text = path.read_text()
        try:
            sha = client.script_load(text)
        except redis.ResponseError as exc:
            pytest.fail(f"{path.name} does not compile: {exc}")
        assert sha == hashlib.sha1(text.encode()).hexdigest()


def test_each_script_the_modules_register_compiles_under_its_texts_sha(client):
    composed = _composed()
    # The job scripts, the moves', the heartbeats', the rate limit, a reload's claims.
    for name in ("tasks.job_lua.SUBMIT", "tasks.job_lua.FINISH", "tasks.job_lua.LIST",
                 "tasks.job_lua.CLAIM_DELIVERY", "tasks.queuemoves.MOVE",
                 "tasks.presence._LIVE", "app.auth._TAKE", "app.reloading._CLAIM",
                 "workers.batching.turns._TAKE", "workers.broker.lua.FETCH",
                 "workers.broker.lua.RECONCILE"):
        assert name in composed, sorted(composed)
    for name, text in composed.items():
        assert "-- #include" not in text, name
        try:
            sha = client.script_load(text)
        except redis.ResponseError as exc:
            pytest.fail(f"{name} does not compile: {exc}")
        assert sha == hashlib.sha1(text.encode()).hexdigest() == \
            client.register_script(text).sha, name


def test_a_constant_reaches_lua_as_the_same_bytes(client):
    for value in (PRIORITY_SEP, "iq:job:", "it's \\ é"):
        assert client.eval(f"return {lua.literal(value)}", 0) == value.encode()
    assert client.eval(f"return {lua.literal(('a', 'b'))}", 0) == [b"a", b"b"]


def test_no_python_module_holds_lua_of_its_own():
    holders = sorted(path for path, text in _sources().items() if "redis.call(" in text)
    assert holders == sorted(STILL_IN_PYTHON), \
        f"Lua in Python strings (move it to tasks/lua/): {sorted(set(holders) - STILL_IN_PYTHON)}"
