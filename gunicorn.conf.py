"""gunicorn's settings for the API, read by every `gunicorn app.wsgi:app` started in this
folder (scripts/web.sh, the tests, a plain command line); flags given on the command line win.

The API waits a lot: `?wait` and `Prefer: wait` hold a request until its job finishes. With
gunicorn's gevent worker each request is a greenlet, not a thread, so thousands can wait
while /healthz, /readyz, /metrics and submits are answered. The worker monkey-patches the
standard library (gevent.monkey.patch_all) in each worker process before it imports the app,
so redis-py and kombu, which the app imports, cooperate: a request blocked on Redis yields to
the others. Do not add --preload: it would import the app, and open its sockets, before that.

This file holds the settings and gunicorn's lifecycle hooks only. The worker class it names, the
API's HTTP/1 parser and answer, and the hand-over across a graceful reload that the hooks keep
are in web/ (web/__init__.py says why there and not under app/).
"""
import functools
import os
import resource
import shutil
import signal
import sys
import tempfile

# A SIGHUP reads this file again in the same master, and the processes it then starts run the
# code on disk, the app's (never imported by the master) and web/'s alike, as when web/'s
# classes were defined in this file: web/ is imported anew at each read. (config/ and
# gunicorn's own modules stay the master's from its start.)
for _name in [name for name in sys.modules if name == "web" or name.startswith("web.")]:
    del sys.modules[_name]

from config import load_settings, start_unless_metrics_folder_fails  # noqa: E402
from web import handover  # noqa: E402
from web.worker import Worker  # noqa: E402

_settings = load_settings()


def default_workers() -> int:
    """A quarter of the cores this process may run on, at least one. One gevent process uses
    one core and carries ~500-1,000 one-input jobs/s (bench/README.md, "On a GPU": it was the
    limit of a 16-core GPU host); the other cores go to the pool children (a core each), the
    worker's main process and Redis. 2 cores: 1 process, 16: 4."""
    return max(1, len(os.sched_getaffinity(0)) // 4)


worker_class = Worker
workers = int(os.environ.get("IQ_WEB_WORKERS") or default_workers())
# /metrics sums the counters of every process (prometheus_client's multiprocess mode), one
# process included: gunicorn may run more than `workers` says here (`-w` or GUNICORN_CMD_ARGS
# win over this file, SIGTTIN adds one while it runs), and a process that counted alone would
# answer a scrape with its own counts, each scrape another process's. Unless the operator names
# a folder, each start gets a fresh one, so that no count from an earlier run is added in; it
# is removed when gunicorn exits. Set here, in gunicorn's master before it forks, so that each
# worker imports prometheus_client with it already set.
_OWN_METRICS = "iq-api-metrics-"


def _own_metrics_folder(folder: str) -> bool:
    """Whether `folder` is the one this master made (its pid in the name). A SIGHUP re-reads
    this file in the same master, which keeps its folder; a master exec'd by a USR2 (gunicorn's
    binary upgrade) after a SIGHUP inherits the variable from its parent and makes its own,
    so that neither removes the other's when it exits."""
    return os.path.basename(folder).startswith(f"{_OWN_METRICS}{os.getpid()}-")


_folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
# Its own folder is made again at a SIGHUP's re-read when it is gone (a cleaner of /tmp): the
# new processes would otherwise fail at their first counter, every answer a 500.
if _folder is None or (os.path.basename(_folder).startswith(_OWN_METRICS)
                       and not (_own_metrics_folder(_folder) and os.path.isdir(_folder))):
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(
        prefix=f"{_OWN_METRICS}{os.getpid()}-")

# prometheus_client's multiprocess counters share one lock a process, made with the `Lock` its
# values module took from `threading` when it was imported. Imported in the worker, after the
# gevent worker patched `threading`, that is gevent's lock, Python code (~10 calls a counter
# write; four writes a request). Imported here, in the master before it forks, it is the
# interpreter's. No greenlet switches while holding it: a write puts a few bytes into an mmap.
import prometheus_client.values  # noqa: E402,F401  (app/metrics.py makes the metrics)


# The hand-over across a graceful reload (web/handover.py): an old process told to stop goes on
# accepting until as many new ones are up as gunicorn runs. Its folder, the master's own, which
# its processes inherit, is made here; the hooks below keep its entries.
handover.own_folder()


def on_reload(server):
    handover.note_reload(server.worker_age + 1)  # spawn_worker's next age


def post_worker_init(worker):
    """The app built: its start-up objects are frozen out of the garbage collector's full
    collections (tasks/heap.py), which otherwise walk them all every few thousand requests;
    then the process says it is up."""
    from tasks.heap import freeze_start_up

    freeze_start_up()
    handover.note_up(worker)


def on_starting(server):
    """Once, as the master starts (not at a SIGHUP's re-read of this file): an operator's
    PROMETHEUS_MULTIPROC_DIR that the workers could not write in stops it, in one line."""
    try:
        start_unless_metrics_folder_fails("the API")
    except SystemExit:
        handover.remove_folder()  # made above for a master that will not run
        raise


def when_ready(server):
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, functools.partial(handover.stop_noted, server.pid, server.signal))


def child_exit(server, worker):
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess
        multiprocess.mark_process_dead(worker.pid)
    handover.note_gone(server, worker)


def on_exit(server):
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
    if _own_metrics_folder(folder):  # made above by this master, not the operator's
        shutil.rmtree(folder, ignore_errors=True)
    handover.remove_folder()


# Connections one worker holds at once: every allowed wait (max_waits) plus room for probes,
# submits and reads beside them. Past it, gunicorn stops accepting until one closes.
worker_connections = _settings.max_waits + 1000
timeout = 60
# A graceful reload (SIGHUP, app/reloading.py) or stop lets the old processes finish what they
# hold, the longest `?wait` included, before they go.
graceful_timeout = int(_settings.max_wait_s) + 5
preload_app = False
control_socket_disable = True
# Proxy headers (SCRIPT_NAME, X-Forwarded-Proto, ...) are honoured from these addresses only;
# none by default. From any other peer a header with an underscore (SCRIPT_NAME) is dropped.
forwarded_allow_ips = _settings.forwarded_allow_ips
header_map = "drop"

# Each connection is a file descriptor; a default soft limit of 1024 would refuse connections
# long before worker_connections. Raise it as far as the hard limit allows.
_soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
_wanted = worker_connections + 256
if _soft != resource.RLIM_INFINITY and _soft < _wanted:
    _limit = _wanted if _hard == resource.RLIM_INFINITY else min(_wanted, _hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_limit, _hard))


def post_fork(server, worker):
    """Each API process knows its gunicorn (its address) and how many processes it runs, for
    a models reload to count them (app/reloading.py)."""
    os.environ["_IQ_API_BIND"] = ",".join(server.cfg.bind)
    os.environ["_IQ_API_PROCESSES"] = str(server.num_workers)
