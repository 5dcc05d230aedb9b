"""gunicorn's settings for the API, read by every `gunicorn app.wsgi:app` started in this
folder (scripts/web.sh, the tests, a plain command line); flags given on the command line win.

The API waits a lot: `?wait` and `Prefer: wait` hold a request until its job finishes. With
gunicorn's gevent worker each request is a greenlet, not a thread, so thousands can wait
while /healthz, /readyz, /metrics and submits are answered. The worker monkey-patches the
standard library (gevent.monkey.patch_all) in each worker process before it imports the app,
so redis-py and kombu, which the app imports, cooperate: a request blocked on Redis yields to
the others. Do not add --preload: it would import the app, and open its sockets, before that.
"""
import os
import resource

from config import load_settings

_settings = load_settings()

worker_class = "gevent"
workers = int(os.environ.get("IQ_WEB_WORKERS", "1"))
# Connections one worker holds at once: every allowed wait (max_waits) plus room for probes,
# submits and reads beside them. Past it, gunicorn stops accepting until one closes.
worker_connections = _settings.max_waits + 1000
timeout = 60
preload_app = False
control_socket_disable = True

# Each connection is a file descriptor; a default soft limit of 1024 would refuse connections
# long before worker_connections. Raise it as far as the hard limit allows.
_soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
_wanted = worker_connections + 256
if _soft != resource.RLIM_INFINITY and _soft < _wanted:
    _limit = _wanted if _hard == resource.RLIM_INFINITY else min(_wanted, _hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_limit, _hard))
