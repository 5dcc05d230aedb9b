"""Redis's instructions a one-input job, by move (bench.lua_cost's moves), counted by valgrind's
callgrind on the private Redis: a figure that the machine's load does not move (the CPU time
of a 2-core machine shared with other work swings by a third between runs), to judge a change
to a script by. Instructions are not time (a cache miss costs more than an instruction; a
malloc tuning tried on these figures took 9 % of the instructions off and ran slower), so a
change is timed too (bench.lua_cost, bench.cpu).

    python -m bench.lua_cost --callgrind 10 [--batch 16]

Needs `valgrind` (with callgrind_control) on PATH. The Redis is started as scripts/stack.py
starts one (scripts/redis-server.sh), its binary run under callgrind with instrumentation off
until the measured batches; after each move a dump is taken (callgrind_control -d), so each
dump holds that move's instructions."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import redis

_TRIGGER = re.compile(r"^desc: Trigger: .*?dump (\S+)", re.M)
_TOTAL = re.compile(r"^(?:summary|totals): (\d+)", re.M)


def _wrapper(folder: Path, out: Path) -> None:
    """A `redis-server` (and its `redis-cli`) on PATH that runs the real one under callgrind."""
    from scripts.redis_nodes import redis_server_binary

    real = Path(redis_server_binary())
    folder.mkdir()
    server = folder / "redis-server"
    server.write_text("#!/bin/sh\nexec valgrind --tool=callgrind --instr-atstart=no "
                      f"--callgrind-out-file={out}/cg.%p {real} \"$@\"\n")
    server.chmod(0o755)
    (folder / "redis-cli").symlink_to(real.with_name("redis-cli"))


def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def instructions(batch: int, batches: int, moves_class: Any) -> dict:
    """Instructions a job by move over `batches` batches of `batch` jobs (after 3 unmeasured)."""
    from scripts.redis_nodes import start_redis

    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        raise SystemExit("--callgrind needs valgrind and callgrind_control on PATH")
    workdir = Path(tempfile.mkdtemp(prefix="iq-lua-cg-"))
    out = workdir / "out"
    out.mkdir()
    _wrapper(workdir / "bin", out)
    path = os.environ["PATH"]
    os.environ["PATH"] = f"{workdir / 'bin'}:{path}"
    try:
        svc = start_redis(workdir)
    finally:
        os.environ["PATH"] = path
    try:
        client = redis.Redis.from_url(svc.extra["url"])
        admin = redis.Redis.from_url(svc.extra["admin_url"], decode_responses=True)
        pid = int(admin.info("server")["process_id"])
        moves = moves_class(client, admin, batch)
        moves._measured = lambda move, trips, fn: fn()
        for _ in range(3):
            moves.one_batch()
        _control(pid, "-i", "on")
        _control(pid, "-z")

        def measured(move: str, trips: int, fn: Any) -> Any:
            result = fn()
            _control(pid, "-d", move)
            return result

        moves._measured = measured
        for _ in range(batches):
            moves.one_batch()
        _control(pid, "-i", "off")
    finally:
        svc.stop()
    totals: Counter = Counter()
    for dump in out.glob("cg.*.*"):
        text = dump.read_text()
        move, total = _TRIGGER.search(text), _TOTAL.search(text)
        if move and total:
            totals[move.group(1)] += int(total.group(1))
    shutil.rmtree(workdir, ignore_errors=True)
    jobs = batch * batches
    by_move = {move: round(n / jobs) for move, n in totals.items()}
    return {"batch": batch, "jobs": jobs, "instructions_per_job": sum(by_move.values()),
            "by_move": by_move}
