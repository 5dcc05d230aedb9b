"""What each Redis command of a job is for: Redis's MONITOR stream, read while a load runs,
with every command (those run inside a Lua script included) given one purpose.

`INFO commandstats` counts a script call (`EVALSHA`) as one call, and every `redis.call` the
script makes as one call of that command too; so does this count: a script's own line is one
command of its purpose, each command it runs one more. `round_trips` counts only what clients
sent (scripts as one).

Purposes: `submit` (the API's submit script), `fetch` (a worker taking messages off their
queue), `lease` (keeping a held message invisible to other workers), `start` (a batch's jobs
marked running, their progress), `result` (outputs stored, the job's answer read), `events`
(Celery's task events, and the job moves' for Server-Sent Events), `ack` (a message removed
for good), `wake-up` (waking a waiting API request or an idle worker), `heartbeat` (liveness,
the same however many jobs run) and `other`. A script is known by its SHA1, found in the tree
that runs it (`script_names`), and given its purpose by name (`SCRIPT_PURPOSES`); a plain
command by its name and its key (`_plain`).
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

PURPOSES = ("submit", "fetch", "lease", "start", "result", "events", "ack", "wake-up",
            "heartbeat", "other")

# Lua scripts by the name their module gives them.
SCRIPT_PURPOSES = {
    "SUBMIT": "submit", "SUBMIT_MANY": "submit", "START": "start", "FINISH": "result",
    "READ": "result",
    "FETCH": "fetch", "_RESTORE": "lease", "PROGRESS": "start", "CRASHED": "start",
    # Issue 24's broker scripts (workers/broker/lua.py): the lease per worker and the
    # recoveries that read it.
    "BEAT": "lease", "REAP": "lease", "RECONCILE": "lease", "RESTORE": "lease",
    "LATER": "other", "_LIVE": "heartbeat", "_STAMP": "heartbeat",
}  # any other (cancel, list, delete, a webhook's claim, the rate limit's): other

_SCRIPT_CALLS = {"EVALSHA", "EVAL", "EVALSHA_RO", "EVAL_RO", "FCALL"}
_LINE = re.compile(rb'^\+?[0-9.]+ \[\d+ ([^\]]+)\] (.*)$')
_ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')

# Lists the script names of one tree's modules, as `{sha1: "module.NAME"}` on stdout: the
# module-level texts of every module that holds Lua (a tree before issue 38) or reads it from
# tasks/lua/ (tasks.lua).
_FIND_SCRIPTS = """
import hashlib, importlib, json, pathlib, sys
sys.path.insert(0, '.')
out = {}
for path in sorted(pathlib.Path('.').glob('*/**/*.py')):
    if path.parts[0] not in ('app', 'tasks', 'workers'):
        continue
    text = path.read_text()
    if 'redis.call' not in text and 'tasks.lua' not in text:
        continue
    module = importlib.import_module('.'.join(path.with_suffix('').parts))
    for name, value in vars(module).items():
        if isinstance(value, str) and 'redis.call' in value:
            out[hashlib.sha1(value.encode()).hexdigest()] = f'{module.__name__}.{name}'
print(json.dumps(out))
"""


def script_names(tree: Path) -> dict[str, str]:
    """{SHA1: module.NAME} of every Lua script the tree's app/, tasks/ and workers/ define."""
    out = subprocess.run([sys.executable, "-c", _FIND_SCRIPTS], cwd=tree, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def _unescape(raw: bytes) -> str:
    return raw.decode("unicode_escape", errors="replace")


def finished_by(cmd: str, args: list[str]) -> int:
    """How many jobs a PUBLISH announces as finished: each id of a "done <id> ..." on the moves
    channel, or the one job of an earlier release's `iq:done:<id>`."""
    if cmd != "PUBLISH" or not args:
        return 0
    if args[0] == "iq:moves" and len(args) > 1 and args[1].startswith("done "):
        return len(args[1].split()) - 1
    return 1 if args[0].startswith("iq:done:") else 0


def _plain(cmd: str, args: list[str]) -> str:
    """The purpose of a command sent on its own (or inside MULTI), by its name and key."""
    key = args[0] if args else ""
    if cmd in ("PUBLISH", "SPUBLISH"):
        # Jobs finished (waking the API's waiting requests): wake-up. Celery's task events and
        # the job moves' other messages (iq:moves, for Server-Sent Events): events.
        if finished_by(cmd, args):
            return "wake-up"
        return "events" if "celeryev" in key or key == "iq:moves" else "other"
    if cmd in ("SUBSCRIBE", "UNSUBSCRIBE", "PSUBSCRIBE", "PUNSUBSCRIBE"):
        return "wake-up"
    if "wake" in key:
        return "wake-up"
    if key in ("iq:consuming",) or key.startswith(("iq:live:", "iq:lease", "iq:worker")):
        return "lease" if key.startswith("iq:lease") else "heartbeat"
    if cmd in ("BRPOP", "BLPOP", "BLMOVE", "BRPOPLPUSH", "BZPOPMIN", "LMOVE", "RPOPLPUSH"):
        return "fetch"
    if key.startswith("unacked") or key.startswith("iq:inflight"):  # kombu's, issue 24's
        if cmd in ("HDEL", "ZREM"):
            return "ack"
        return "fetch" if cmd == "HSET" else "lease"
    if key.startswith("celery-task-meta-") or key.startswith("iq:job:"):
        return "result"
    return "other"


class Tally:
    """Commands seen, by purpose: all (inner commands of scripts included, as commandstats
    counts them) and round trips (what clients sent)."""

    def __init__(self, scripts: dict[str, str]) -> None:
        self.scripts = scripts
        self.commands: Counter[str] = Counter()
        self.round_trips: Counter[str] = Counter()
        self.by_command: Counter[str] = Counter()
        self.unknown_scripts: Counter[str] = Counter()
        self.jobs_finished = 0
        self._multi: dict[str, list[str]] = {}

    def _script_purpose(self, sha: str) -> str:
        name = self.scripts.get(sha.lower())
        if name is None:
            self.unknown_scripts[sha] += 1
            return "other"
        return SCRIPT_PURPOSES.get(name.rsplit(".", 1)[1], "other")

    def top(self, client: str, cmd: str, args: list[str]) -> str:
        """A command a client sent; returns its purpose (the one its script's commands take)."""
        if cmd == "MULTI":  # counted with its EXEC, as what it wraps
            self._multi[client] = []
            return "other"
        if cmd == "EXEC" and client in self._multi:
            inside = self._multi.pop(client)
            purpose = inside[0] if inside else "other"
            self.count(purpose, "MULTI", top=True)
        elif cmd in _SCRIPT_CALLS:
            purpose = self._script_purpose(args[0]) if cmd.startswith("EVALSHA") \
                else "other"
        else:
            purpose = _plain(cmd, args)
        if client in self._multi and cmd != "EXEC":
            self._multi[client].append(purpose)
        self.count(purpose, cmd, top=True)
        return purpose

    def inner(self, script_purpose: str, cmd: str, args: list[str]) -> None:
        """A command run by a script: its script's purpose, but for a publish (events, or the
        wake-up of a waiting request)."""
        if cmd == "PUBLISH":
            self.jobs_finished += finished_by(cmd, args)
            purpose = _plain(cmd, args)
        else:
            purpose = script_purpose
        self.count(purpose, cmd, top=False)

    def count(self, purpose: str, cmd: str, top: bool) -> None:
        self.commands[purpose] += 1
        self.by_command[cmd.lower()] += 1
        if top:
            self.round_trips[purpose] += 1

    def feed(self, lines: list[bytes], scripts_first: bool) -> None:
        """MONITOR's lines in order. `scripts_first`: Redis before 7 shows a script's line
        before the commands it runs; 7 and later after them."""
        last_script, pending = "other", []
        for line in lines:
            m = _LINE.match(line)
            if not m:
                continue
            source, rest = m.group(1).decode(), m.group(2)
            parts = [_unescape(a) for a in _ARG.findall(rest)]
            if not parts:
                continue
            cmd, args = parts[0].upper(), parts[1:]
            if source == "lua":
                if scripts_first:
                    self.inner(last_script, cmd, args)
                else:
                    pending.append((cmd, args))
                continue
            if cmd == "INFO" and args and args[0].lower() == "commandstats":
                continue  # the benchmark's own snapshot
            self.jobs_finished += finished_by(cmd, args)
            purpose = self.top(source, cmd, args)
            if cmd in _SCRIPT_CALLS:
                last_script = purpose
                for inner_cmd, inner_args in pending:
                    self.inner(purpose, inner_cmd, inner_args)
                pending = []

    def per_job(self, jobs: int) -> dict:
        jobs = max(jobs, 1)
        return {
            "jobs": jobs,
            "total": round(sum(self.commands.values()) / jobs, 2),
            "round_trips_total": round(sum(self.round_trips.values()) / jobs, 2),
            "by_purpose": {p: round(self.commands[p] / jobs, 2) for p in PURPOSES
                           if self.commands[p]},
            "round_trips": {p: round(self.round_trips[p] / jobs, 2) for p in PURPOSES
                            if self.round_trips[p]},
            "by_command": {c: round(n / jobs, 2) for c, n in self.by_command.most_common()},
            **({"unknown_scripts": dict(self.unknown_scripts)} if self.unknown_scripts
               else {}),
        }


class Monitor:
    """Redis's MONITOR stream, read raw into memory on a thread of its own (parsing waits
    until `stop`, so the reader keeps up with a loaded Redis)."""

    def __init__(self, admin_url: str) -> None:
        url = urlparse(admin_url)
        self.sock = socket.create_connection((url.hostname, url.port or 6379))
        if url.password:
            user = url.username or "default"
            self._command(f"AUTH {user} {url.password}")
        self.sock.sendall(b"MONITOR\r\n")
        assert self.sock.recv(5) == b"+OK\r\n"
        self.chunks: list[bytes] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _command(self, text: str) -> None:
        self.sock.sendall(text.encode() + b"\r\n")
        reply = self.sock.recv(64)
        if not reply.startswith(b"+OK"):
            raise RuntimeError(f"Redis refused {text.split()[0]}: {reply!r}")

    def _read(self) -> None:
        while True:
            try:
                chunk = self.sock.recv(1 << 20)
            except OSError:
                return
            if not chunk:
                return
            self.chunks.append(chunk)

    def stop(self) -> list[bytes]:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(10)
        self.sock.close()
        return b"".join(self.chunks).split(b"\r\n")
