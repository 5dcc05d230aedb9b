"""An API process's canary of a reload's models file (app/reloading.py): before the process asks
its gunicorn master to reload, the new file must build the app in a process of its own, with
the API process's own environment, and reach every Redis its models use. A master whose new
processes cannot boot exits, which once took the API down for ten minutes; a canary that fails
leaves the master alone and the old file served.

    python -m app.canary REVISION

Exit 0 when the app built from the models file of that revision reached its Redis; else one
line on stdout (why), exit 1; exit 75 (EX_TEMPFAIL) when REDIS_URL's Redis did not answer: the
API process's own Redis, frozen or away for a while, is no fault of the file, so the process
tries the canary again at its next heartbeat rather than refuse the file (a Redis freeze
during a good reload once had it refused and undone)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from subprocess import PIPE

import redis

from config import ConfigError
from tasks.reload_failures import one_line

CANARY_TIMEOUT_S = 60.0
UNANSWERED = 75  # EX_TEMPFAIL: REDIS_URL's Redis did not answer


class Unanswered(RuntimeError):
    """REDIS_URL's Redis did not answer the canary."""


def check(revision: str) -> None:
    """Raises when the app cannot be built from the models file of `revision`, or a Redis its
    models use (REDIS_URL's, their groups') does not answer."""
    from app import create_app

    app = create_app()
    built = app.extensions["iq.revision"]
    if built != revision:
        raise RuntimeError(f"the models file has revision {built} now, not the announced "
                           f"{revision}")
    used = {""} | {spec.redis for spec in app.extensions["iq.models"].values()}
    for group, store in app.extensions["iq.store"].stores.items():
        if group not in used:  # a group no model names: not this file's to wait for
            continue
        try:
            store.redis.ping()
        except Exception as exc:  # noqa: BLE001 - said, with which Redis
            if not group:
                raise Unanswered(f"REDIS_URL's Redis did not answer: {one_line(exc)}") from None
            raise RuntimeError(f"Redis group {group!r} did not answer: {one_line(exc)}") \
                from None


def _why(done: subprocess.CompletedProcess) -> str:
    lines = (done.stdout.strip() or done.stderr.strip()).splitlines()
    return lines[-1] if lines else f"it exited with status {done.returncode}"


def _finish(process: subprocess.Popen, deadline: float) -> subprocess.CompletedProcess:
    """`process` waited on to its end, or killed at `deadline` (subprocess.TimeoutExpired)."""
    try:
        out, err = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def run(revision: str, timeout_s: float = CANARY_TIMEOUT_S) -> str:
    """In the API process: why the canary of `revision` failed, "" when it started;
    redis.ConnectionError when REDIS_URL's Redis did not answer it (tried again later).

    Beside it, in the same folder, web/canary.py checks that what gunicorn's master reads at
    the SIGHUP (gunicorn.conf.py, web/) loads: a master that cannot read it exits. Run by
    module name, not imported (app/ and web/ are side by side), at the same time (~0.15 s
    against the app canary's seconds)."""
    env = dict(os.environ)
    # The canary's metrics would count among the API's (prometheus_client's multiprocess
    # folder), its spans among its traces.
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env["OTEL_SDK_DISABLED"] = "true"
    app = [sys.executable, "-m", "app.canary", revision]
    web = [sys.executable, "-m", "web.canary"]
    deadline = time.monotonic() + timeout_s
    try:
        with subprocess.Popen(web, env=env, stdout=PIPE, stderr=PIPE, text=True) as checks, \
                subprocess.Popen(app, env=env, stdout=PIPE, stderr=PIPE, text=True) as canary:
            try:
                done = {"web": _finish(checks, deadline), "app": _finish(canary, deadline)}
            except subprocess.TimeoutExpired:
                for process in (checks, canary):
                    process.kill()
                return f"it did not start within {timeout_s:g}s"
    except OSError as exc:
        return f"it could not be run: {exc}"
    # The web server's code not loading refuses the reload whatever the app canary says:
    # no Redis coming back makes it load.
    if done["web"].returncode != 0:
        return f"the web server's code on disk: {_why(done['web'])}"
    if done["app"].returncode == 0:
        return ""
    why = _why(done["app"])
    if done["app"].returncode == UNANSWERED:
        raise redis.ConnectionError(f"the canary of revision {revision}: {why}")
    return why


def main(argv: list[str]) -> int:
    try:
        check(argv[1])
    except ConfigError as exc:  # names the field and the value already
        print(str(exc).splitlines()[0], flush=True)
        return 1
    except Unanswered as exc:
        print(one_line(exc), flush=True)
        return UNANSWERED
    except BaseException as exc:  # noqa: BLE001 - any failure is the canary's answer
        print(one_line(exc), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
