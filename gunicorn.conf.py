"""gunicorn's settings for the API, read by every `gunicorn app.wsgi:app` started in this
folder (scripts/web.sh, the tests, a plain command line); flags given on the command line win.

The API waits a lot: `?wait` and `Prefer: wait` hold a request until its job finishes. With
gunicorn's gevent worker each request is a greenlet, not a thread, so thousands can wait
while /healthz, /readyz, /metrics and submits are answered. The worker monkey-patches the
standard library (gevent.monkey.patch_all) in each worker process before it imports the app,
so redis-py and kombu, which the app imports, cooperate: a request blocked on Redis yields to
the others. Do not add --preload: it would import the app, and open its sockets, before that.
"""
import json
import os
import resource

from gunicorn import util
from gunicorn.http.errors import ConfigurationProblem, InvalidHeader
from gunicorn.workers.ggevent import GeventWorker

from config import load_settings

_settings = load_settings()


def _json_error(sock, status_int, reason, mesg):
    """gunicorn's own error answers (a malformed request line or header, headers too large,
    a proxy header it refuses) in the API's JSON envelope rather than an HTML page."""
    code = {400: "malformed_request", 500: "internal"}.get(
        status_int, reason.lower().replace(" ", "_"))
    body = json.dumps({"error": {"code": code, "message": mesg or reason}}).encode()
    head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    util.write_nonblock(sock, head.encode("latin-1") + body)


class Worker(GeventWorker):
    """gunicorn's gevent worker, answering its own errors as JSON. A SCRIPT_NAME header from a
    trusted proxy that does not prefix the path is the request's fault: 400, not 500."""

    def init_process(self):
        util.write_error = _json_error  # what Worker.handle_error writes its answer with
        super().init_process()

    def handle_error(self, req, client, addr, exc):
        if isinstance(exc, ConfigurationProblem) and "SCRIPT_NAME" in str(exc):
            exc = InvalidHeader("SCRIPT_NAME", req=req)
        super().handle_error(req, client, addr, exc)


worker_class = Worker
workers = int(os.environ.get("IQ_WEB_WORKERS", "1"))
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
